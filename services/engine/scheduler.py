"""The continuous-batching scheduler.

One rule: each request has `num_computed_tokens` and `num_tokens`; `schedule()` spends one token
budget closing that gap, running requests first, then waiting ones. Chunked prefill, prefix-cache
hits and preemption by recompute all follow from it. `num_computed_tokens` advances here, at
schedule time, so the next schedule never hands out the same chunk twice.

Speculative decoding (a `Speculator`): a decoding request also computes the tokens drafted after its
next one, so `num_computed_tokens` runs ahead of `num_tokens` until the step's output says how many
drafts the worker accepted; the rejected ones are taken back then. Their KV slots stay the request's
(the blocks are reused by the tokens that follow) and are never cached: a block is cached only once
its tokens are all known.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.common.engine_output import EngineCoreOutput
from services.common.errors import EngineOverloadedError
from services.common.model_runner_output import ModelRunnerOutput
from services.common.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from services.engine.chunk_policy import AdaptiveChunking
from services.engine.kv_cache_manager import KVCacheManager
from services.engine.lora_registry import LoRAStepLimit
from services.engine.request import Request, RequestStatus
from services.engine.request_queue import make_request_queue
from services.engine.speculator import Speculator


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        policy: str = "fcfs",
        max_num_waiting: int | None = None,
        chunking: AdaptiveChunking | None = None,
        lora_limit: LoRAStepLimit | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        # How many prompt tokens one request may compute per step (None: the whole budget).
        self.chunking = chunking or AdaptiveChunking(max_num_batched_tokens, target_seconds=0.0)
        self.max_num_seqs = max_num_seqs
        # LoRA: at most max_loras adapters a step (the worker's slots); none without LoRA.
        self.lora_limit = lora_limit or LoRAStepLimit(None)
        # Counted over every request held (running or not), so that how many are admitted does not
        # depend on whether a step ran in between: exactly max_num_seqs + max_num_waiting.
        self.max_num_requests = None if max_num_waiting is None else max_num_seqs + max_num_waiting
        self.max_model_len = max_model_len
        self.speculator = speculator  # None: no speculative decoding
        self.requests: dict[str, Request] = {}
        self.waiting = make_request_queue(policy)
        self.running: list[Request] = []
        # Requests whose worker state must be dropped on the next step.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        # Prompt logprobs gathered over a request's prefill chunks, emitted with its first token.
        self._prompt_logprobs: dict[str, list] = {}

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if self.max_num_requests is not None and len(self.requests) >= self.max_num_requests:
            raise EngineOverloadedError(
                f"the engine is full ({self.num_running} running, {self.num_waiting} waiting; at most "
                f"{self.max_num_seqs} running and {self.max_num_requests - self.max_num_seqs} more waiting); "
                "try again later")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def add_prefilled_request(self, request: Request, token_id: int) -> EngineCoreOutput:
        """A request whose prompt another engine computed and sampled `token_id` from (disaggregation):
        the token is its first output; unless that finished it, it joins the waiting
        queue, where its admission hits the transferred blocks in the prefix cache and computes only
        the prompt's last partial block and the token. The first token's output, to stream."""
        request.append_output_token_ids([token_id])
        self._check_stop(request, token_id)
        output = EngineCoreOutput(request.request_id, [token_id])
        if request.is_finished:
            output.finish_reason = request.status.finish_reason
            output.stop_reason = request.stop_reason
            return output
        self.add_request(request)
        return output

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside the step (aborts). Idempotent; unknown ids are ignored."""
        assert status.finished
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)  # aborts only: off the step's hot path
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            finished.append(request)
        return finished

    def _free(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        self._prompt_logprobs.pop(request.request_id, None)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        # Prompt tokens this whole step may compute, shared first come, first served: a decode's one
        # token is never cut, and prompts are read one after another rather than side by side, so the
        # first prompt's first token comes after its own prefill, not after everyone's.
        prefill_budget = self.chunking.max_prefill_tokens()
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: dict[str, CachedRequestData] = {}
        spec_tokens: dict[str, list[int]] = {}
        preempted: list[Request] = []
        self.lora_limit.begin()

        # Running requests first. A request that cannot get blocks preempts the policy's victim
        # (possibly itself) until it fits.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, f"running request with nothing to compute: {request}"
            if not self.lora_limit.admits(request):
                index += 1  # its adapter's turn comes when the adapters ahead of it leave the step
                continue
            if num_new > 1:  # a prompt still being read (or recomputed)
                num_new = min(num_new, prefill_budget)
                if num_new == 0:
                    index += 1  # its turn comes when the prompts ahead of it are read
                    continue
                prefill_budget -= num_new
            drafts = self._draft(request, budget - num_new)
            num_new += len(drafts)
            self.lora_limit.add(request)
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            while new_blocks is None:
                # Only requests not yet scheduled this step are candidates: a scheduled one has
                # blocks already cached whose KV this step has not written yet.
                victim = self.waiting.choose_victim(self.running[index:])
                self._preempt(victim, self.running.index(victim, index))
                preempted.append(victim)
                if victim is request:
                    break
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is None:
                continue  # `request` preempted itself; the one now at `index` is next
            cached_reqs[request.request_id] = CachedRequestData(
                request.request_id, [b.block_id for b in new_blocks], request.num_computed_tokens
            )
            num_scheduled[request.request_id] = num_new
            if drafts:
                spec_tokens[request.request_id] = drafts
            request.num_computed_tokens += num_new
            budget -= num_new
            index += 1

        # Then waiting requests, unless this step preempted (they would only evict each other).
        while (not preempted and self.waiting and budget > 0 and prefill_budget > 0
               and len(self.running) < self.max_num_seqs):
            request = self.waiting.peek()
            if not self.lora_limit.admits(request):
                # No request is admitted past it, so that an adapter in every step (its requests
                # keep coming) cannot starve the others: the next steps drain the adapters ahead.
                break
            hits, num_hit_tokens = self._prefix_hits(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget, prefill_budget)
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new, hits, num_hit_tokens)
            if new_blocks is None:
                break
            prefill_budget -= num_new
            self.waiting.pop()
            self.lora_limit.add(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens = num_hit_tokens + num_new
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            new_reqs.append(NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                stop_token_ids=request.eos_token_ids | request.sampling_params.all_stop_token_ids,
                block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                num_computed_tokens=num_hit_tokens,
                lora_request=request.lora_request,
            ))

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=list(cached_reqs.values()),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=self.finished_req_ids,
            num_preempted=len(preempted),
            scheduled_spec_decode_tokens=spec_tokens,
        )
        self.finished_req_ids = set()
        return output

    def _draft(self, request: Request, budget: int) -> list[int]:
        """Drafted tokens to verify after a decoding request's next token, within the step's `budget`.
        They stop short of the context's end and of max_tokens: the worker writes each accepted draft
        and one more token into the request's row."""
        if self.speculator is None or request.num_tokens - request.num_computed_tokens != 1:
            return []
        room = min(budget, self.max_model_len - request.num_tokens - 1,
                   request.max_tokens - request.num_output_tokens - 1)
        return self.speculator.draft(request, room, len(self.running))

    def _prefix_hits(self, request: Request) -> tuple[list, int]:
        # Prompt logprobs need every prompt position computed, so such requests take no hits.
        if request.sampling_params.prompt_logprobs is not None:
            return [], 0
        return self.kv_cache_manager.get_computed_blocks(request)

    def _preempt(self, request: Request, index: int) -> None:
        """Preemption by recompute: drop the blocks, start over from the waiting queue's front."""
        del self.running[index]
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._prompt_logprobs.pop(request.request_id, None)
        self.finished_req_ids.add(request.request_id)
        self.waiting.add_preempted(request)

    # ------------------------------------------------------------------ results

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        any_finished = False
        for request_id, chunk in runner_output.prompt_logprobs.items():
            if request_id in self.requests:
                self._prompt_logprobs.setdefault(request_id, []).extend(chunk)

        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        logprobs_start = 0  # logprobs are aligned with the step's tokens: each request's accepted drafts, then its own
        for i, request_id in enumerate(runner_output.req_ids):
            drafts = spec_tokens.get(request_id, ())
            num_accepted = runner_output.num_accepted_drafts[i] if drafts else 0
            num_new = num_accepted + 1
            logprobs_start += num_new
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            if drafts:
                # The rejected drafts' KV is garbage: compute from the first of them again.
                request.num_computed_tokens -= len(drafts) - num_accepted
                self.speculator.record(request, len(drafts), num_accepted, len(self.running))
            new_token_ids = [*drafts[:num_accepted], runner_output.sampled_token_ids[i]]
            for num_new, token_id in enumerate(new_token_ids, 1):
                request.append_output_token_ids([token_id])
                self._check_stop(request, token_id)
                if request.is_finished:
                    break  # a stop inside the accepted drafts: the tokens after it are not the output's
            error = None if request.grammar is None else self._advance_grammar(request, new_token_ids[:num_new])
            output = EngineCoreOutput(request_id, new_token_ids[:num_new], num_cached_tokens=request.num_cached_tokens,
                                      error=error)
            if runner_output.logprobs is not None:
                first = logprobs_start - num_accepted - 1
                output.new_logprobs = runner_output.logprobs[first : first + num_new]
            if request.num_output_tokens == num_new:
                output.new_prompt_logprobs = self._prompt_logprobs.pop(request_id, [])
            if request.is_finished:
                output.finish_reason = request.status.finish_reason
                output.stop_reason = request.stop_reason
                self._free(request)
                any_finished = True
            outputs.append(output)
        for request_id, reason in runner_output.failed.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.status = RequestStatus.FINISHED_ERROR
            self._free(request)
            any_finished = True
            outputs.append(EngineCoreOutput(request_id, [], finish_reason=request.status.finish_reason, error=reason))
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    @staticmethod
    def _advance_grammar(request: Request, token_ids: list[int]) -> str | None:
        """Structured outputs: the step's kept tokens move the request's matcher on (a complete grammar
        ends the request before the next step: EngineCore._finish_complete_grammars; no draft completes
        it, Speculator.draft cut such drafts). Returns why the request fails when the grammar refuses
        a token."""
        if not request.grammar.accept(token_ids):
            request.status = RequestStatus.FINISHED_ERROR
            return f"request {request.request_id}: tokens {token_ids} do not fit its structured output's grammar"
        return None

    def _check_stop(self, request: Request, token_id: int) -> None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id in request.eos_token_ids and not params.ignore_eos:
                request.status = RequestStatus.FINISHED_STOPPED
                return
            if token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH

    # ------------------------------------------------------------------ stats

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def check_integrity(self) -> None:
        self.kv_cache_manager.check_integrity()
        running_ids = {r.request_id for r in self.running}
        waiting_ids = {r.request_id for r in self.waiting}
        assert not running_ids & waiting_ids, "a request is both running and waiting"
        assert running_ids | waiting_ids == set(self.requests), "requests lost or leaked"
        assert all(r.status == RequestStatus.RUNNING for r in self.running)
        assert len(self.running) <= self.max_num_seqs
        assert self.max_num_requests is None or len(self.requests) <= self.max_num_requests
