"""EngineCore: the scheduler and KV-cache manager driving a worker step by step."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Protocol

from services.common.clients import EngineStats, LoRAState, PrefixMatch, WorkerClient, WorkerInfo
from services.common.config import GrammarLimits, LoRAConfig, SchedulerConfig
from services.common.hashing import BlockHash
from services.common.lora import LoRARequest, base_config_of, check_adapter
from services.common.engine_output import EngineCoreOutput, EngineCoreRequest
from services.common.model_runner_output import ModelRunnerOutput
from services.common.scheduler_output import GrammarBitmask, SchedulerOutput
from services.common.validation import check_engine_request
from services.engine.chunk_policy import AdaptiveChunking
from services.engine.kv_cache_manager import KVCacheManager
from services.engine.kv_event_queue import KVEventQueue
from services.engine.lora_registry import LoRARegistry, LoRASlots, LoRAStepLimit
from services.engine.request import Request, RequestStatus
from services.engine.scheduler import Scheduler
from services.engine.speculator import Speculator
from services.engine.structured_output import GrammarError, StructuredOutputManager


class Executor(Protocol):
    """What the engine needs of its worker(s): in-process today, over gRPC in the services."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class EngineCore:
    """`step()` runs schedule() -> executor.execute_model() -> update_from_output() synchronously.
    AsyncEngine (services/engine/async_engine.py) passes executor=None and calls its worker between
    `schedule()` and `update_from_output()` itself, on its engine-loop thread."""

    def __init__(self, executor: Executor | None, worker_info: WorkerInfo, num_blocks: int,
                 scheduler_config: SchedulerConfig, *, kv_events: KVEventQueue | None = None,
                 grammar_limits: GrammarLimits = GrammarLimits(), lora: LoRAConfig = LoRAConfig()) -> None:
        """`worker_info` and `num_blocks` are what the worker said of itself (its model, its block
        size, the KV cache it allocated). `kv_events`: the prefix-index publisher's queue of cache
        changes (services/engine/kv_publisher.py); None: none recorded. `grammar_limits`: what a
        request's constraint may hold and its compile may take. `lora`: the adapters served (with
        enable_lora) and how many one step may run."""
        self.executor = executor
        self.kv_events = kv_events
        self.worker_info = worker_info
        self.block_size = worker_info.block_size
        self.model_id = worker_info.model_id
        self.vocab_size = worker_info.vocab_size
        self.scheduling_policy = scheduler_config.policy
        self.enable_prefix_caching = scheduler_config.enable_prefix_caching
        # A context longer than the whole KV cache could never be scheduled.
        self.max_model_len = min(worker_info.max_model_len, num_blocks * self.block_size)
        # LoRA: the adapters by name (None: LoRA off, a request naming one is refused).
        self.loras = LoRARegistry(lora.lora_modules) if lora.enable_lora else None
        self.max_loras, self.max_lora_rank = lora.max_loras, lora.max_lora_rank
        self.lora_slots = LoRASlots(lora.max_loras)  # which adapters the worker's slots hold
        # Unloaded adapters whose last requests are still in flight, by id: the worker drops each
        # once none is left (SchedulerOutput.removed_lora_ids).
        self._retiring: dict[int, LoRARequest] = {}
        self.lora_state: LoRAState | None = None  # as of the last step; stats() reads it from any thread
        self.kv_cache_manager = KVCacheManager(num_blocks, self.block_size, scheduler_config.enable_prefix_caching,
                                               kv_events)
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            max_num_seqs=scheduler_config.max_num_seqs,
            max_model_len=self.max_model_len,
            policy=scheduler_config.policy,
            max_num_waiting=scheduler_config.max_num_waiting,
            chunking=AdaptiveChunking(scheduler_config.max_num_batched_tokens, scheduler_config.target_step_seconds),
            lora_limit=LoRAStepLimit(lora.max_loras if lora.enable_lora else None),
            speculator=None if scheduler_config.speculative_config is None
            else Speculator(scheduler_config.speculative_config),
        )
        # Structured outputs: requests wait here, outside the scheduler, until their grammar compiled.
        self.structured_output = StructuredOutputManager(
            worker_info.model_path, worker_info.vocab_size, compile_timeout=grammar_limits.grammar_compile_timeout,
            max_workers=grammar_limits.grammar_compile_threads, limits=grammar_limits)
        self._waiting_for_grammar: dict[str, Request] = {}
        # Outputs of requests their grammar ended outside a step's results: failed compiles, and
        # requests whose grammar is complete (they end at once, without sampling an EOS).
        self._grammar_outputs: list[EngineCoreOutput] = []
        self._update_lora_state()

    @classmethod
    def create(cls, worker: WorkerClient, scheduler_config: SchedulerConfig,
               executor: Executor | None = None, kv_events: KVEventQueue | None = None,
               grammar_limits: GrammarLimits = GrammarLimits(), lora: LoRAConfig = LoRAConfig()) -> EngineCore:
        """Ask the worker for its model and block size, have it allocate its KV cache for
        `max_num_seqs` requests, and build the core over what it has. Blocking."""
        worker_info = worker.get_info()
        num_blocks = worker.initialize_cache(scheduler_config.max_num_seqs)
        return cls(executor, worker_info, num_blocks, scheduler_config, kv_events=kv_events,
                   grammar_limits=grammar_limits, lora=lora)

    def check_request(self, request: EngineCoreRequest) -> None:
        """ValueError unless the request fits this engine (the processor checked it too; the engine
        trusts no caller). Reads nothing that changes: safe from any thread."""
        check_engine_request(request, self.max_model_len, self.vocab_size)
        self.lora_request_of(request)
        if request.priority and self.scheduling_policy != "priority":
            # As vLLM: a priority the scheduler would ignore is the caller's mistake, said at once.
            raise ValueError(f"priority is not supported by the {self.scheduling_policy!r} scheduling policy; "
                             "start the engine with --scheduling-policy priority")

    def lora_request_of(self, request: EngineCoreRequest) -> LoRARequest | None:
        """The adapter `request` names (None: the base model); ValueError for one not served here."""
        if request.lora_name is None:
            return None
        if self.loras is None:
            raise ValueError(f"LoRA adapter {request.lora_name!r} asked of an engine without LoRA: start it with "
                             "--enable-lora")
        return self.loras.resolve(request.lora_name)

    def add_lora(self, name: str, path: str) -> LoRARequest:
        """Serve the PEFT folder `path` as `name` from the next step on (engine-loop thread): its
        folder, rank and modules checked, and its shapes too when the model is a folder with a
        config.json. ValueError naming the problem, or a name already served."""
        if self.loras is None:
            raise ValueError("LoRA adapters are off on this engine: start it with --enable-lora")
        if not name or not path:
            raise ValueError("Both 'lora_name' and 'lora_path' must be provided.")
        check_adapter(path, self.max_lora_rank, base_config_of(self.worker_info.model_path))
        lora = self.loras.load(name, path)
        self._update_lora_state()
        return lora

    def remove_lora(self, name: str) -> None:
        """Refuse new requests naming `name` at once (ModelNotFoundError when not served); its
        requests in flight finish with it, and the worker frees it after the last (engine-loop thread)."""
        if self.loras is None:
            raise ValueError("LoRA adapters are off on this engine: start it with --enable-lora")
        lora = self.loras.remove(name)
        self._retiring[lora.lora_int_id] = lora
        self._update_lora_state()

    def has_removed_loras(self) -> bool:
        """Unloaded adapters the worker still holds: a step (even an empty one) frees the idle ones."""
        return bool(self._retiring)

    def _retire_loras(self, output: SchedulerOutput) -> None:
        """Tell the worker to drop the unloaded adapters no request holds any more."""
        held = {r.lora_request.lora_int_id for r in (*self.scheduler.requests.values(),
                                                     *self._waiting_for_grammar.values())
                if r.lora_request is not None}
        output.removed_lora_ids = sorted(set(self._retiring) - held)
        for lora_id in output.removed_lora_ids:
            del self._retiring[lora_id]
            self.lora_slots.remove(lora_id)

    def _update_lora_state(self) -> None:
        """The snapshot stats() and the metrics read (vLLM's running / waiting adapters, plus the
        served ones and those in slots). Once a step, over the requests held: no per-token work."""
        if self.loras is None:
            return
        running = {r.lora_request.lora_name for r in self.scheduler.running if r.lora_request is not None}
        waiting = [r.lora_request for r in (*self.scheduler.waiting, *self._waiting_for_grammar.values())
                   if r.lora_request is not None]
        # vLLM's "deferred": waiting for a slot, not for capacity (every slot runs another adapter).
        full = len(running) >= self.max_loras
        names = {**{i: lora.lora_name for i, lora in self._retiring.items()},
                 **{self.loras.resolve(n).lora_int_id: n for n in self.loras.names}}
        self.lora_state = LoRAState(
            adapters=tuple(sorted(self.loras.names)), running=tuple(sorted(running)),
            waiting=tuple(sorted({lora.lora_name for lora in waiting})),
            loaded=tuple(sorted(names[i] for i in self.lora_slots.loaded if i in names)),
            max_loras=self.max_loras, num_deferred=sum(full and lora.lora_name not in running for lora in waiting))

    def add_request(self, request: EngineCoreRequest) -> None:
        engine_request = self.make_request(request)
        constraint = request.sampling_params.structured_outputs
        if constraint is None:
            self.scheduler.add_request(engine_request)
            return
        if request.request_id in self._waiting_for_grammar or request.request_id in self.scheduler.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.structured_output.submit(request.request_id, constraint, request.eos_token_ids)
        self._waiting_for_grammar[request.request_id] = engine_request

    def make_request(self, request: EngineCoreRequest) -> Request:
        """The scheduler's Request for `request`, checked (ValueError); not added."""
        self.check_request(request)
        limit = self.max_model_len - len(request.prompt_token_ids)
        max_tokens = request.sampling_params.max_tokens
        return Request(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            max_tokens=limit if max_tokens is None else min(max_tokens, limit),
            eos_token_ids=request.eos_token_ids,
            block_size=self.block_size,
            model_id=self.model_id,
            cache_salt=request.cache_salt,
            priority=request.priority,
            group_id=request.group_id or request.request_id,
            tenant_id=request.tenant_id,
            lora_request=self.lora_request_of(request),
            arrival_time=request.arrival_time if request.arrival_time is not None else time.monotonic(),
        )

    def _admit_compiled(self) -> None:
        """Requests whose grammar compiled join the scheduler; a failed compile fails its request."""
        for request_id, request in list(self._waiting_for_grammar.items()):
            try:
                grammar = self.structured_output.ready(request_id)
                if grammar is None:
                    continue
                request.grammar = grammar
                self.scheduler.add_request(request)
            except (GrammarError, ValueError) as exc:  # ValueError: the scheduler refused it
                self._grammar_outputs.append(EngineCoreOutput(request_id, [], finish_reason="error", error=str(exc)))
            del self._waiting_for_grammar[request_id]

    def _finish_complete_grammars(self) -> None:
        """Requests whose grammar is complete end now (finish_reason stop, no new token): nothing but
        EOS could follow, and sampling it would cost a step, or fail when min_tokens masks EOS."""
        done = [r.request_id for r in self.scheduler.running if r.grammar is not None and r.grammar.is_complete]
        if done:
            self.scheduler.finish_requests(done, RequestStatus.FINISHED_STOPPED)
            self._grammar_outputs += [EngineCoreOutput(request_id, [], finish_reason="stop") for request_id in done]

    def take_grammar_outputs(self) -> list[EngineCoreOutput]:
        """The requests their grammar ended since the last call: failed compiles (error outputs) and
        complete grammars (stop)."""
        outputs, self._grammar_outputs = self._grammar_outputs, []
        return outputs

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Idempotent, also for unknown or already finished ids; the worker drops them next step."""
        request_ids = list(request_ids)
        for request_id in request_ids:
            if self._waiting_for_grammar.pop(request_id, None) is not None:
                self.structured_output.forget(request_id)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> list[EngineCoreOutput]:
        assert self.executor is not None, "no executor: drive schedule() / update_from_output() yourself"
        scheduler_output = self.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        return self.update_from_output(scheduler_output, runner_output)

    def schedule(self) -> SchedulerOutput:
        if self._waiting_for_grammar:
            self._admit_compiled()
        self._finish_complete_grammars()
        output = self.scheduler.schedule()
        output.grammar_bitmask = self._grammar_bitmask(output)
        if self.loras is not None:
            if self._retiring:
                self._retire_loras(output)
            requests = self.scheduler.requests
            self.lora_slots.step(requests[r].lora_request.lora_int_id for r in output.num_scheduled_tokens
                                 if requests[r].lora_request is not None)
            self._update_lora_state()
        return output

    def _grammar_bitmask(self, output: SchedulerOutput) -> GrammarBitmask | None:
        """The masks of the constrained requests that sample this step: those whose scheduled tokens
        reach their last known token and drafts (num_computed_tokens advanced at schedule time). A
        request with d drafts has d + 1 rows in a row, one per sampled position."""
        requests = self.scheduler.requests
        spec = output.scheduled_spec_decode_tokens
        sampling = [requests[r] for r in output.num_scheduled_tokens if requests[r].grammar is not None]
        sampling = [r for r in sampling if r.num_computed_tokens == r.num_tokens + len(spec.get(r.request_id, ()))]
        if not sampling:
            return None
        drafts = [spec.get(r.request_id, ()) for r in sampling]
        return GrammarBitmask([r.request_id for r, d in zip(sampling, drafts) for _ in range(len(d) + 1)],
                              self.structured_output.bitmask([r.grammar for r in sampling], drafts))

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = self.take_grammar_outputs() + self.scheduler.update_from_output(scheduler_output, runner_output)
        self._update_lora_state()
        return outputs

    def record_step_time(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """How long a step took (schedule to outputs): the prefill chunks that follow are sized from
        it (services/engine/chunk_policy.py). A service's engine calls this; the offline `step()`
        does not, and always computes full chunks (throughput, not latency)."""
        self.scheduler.chunking.record_step(scheduler_output.total_num_scheduled_tokens, seconds)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._waiting_for_grammar or self._grammar_outputs)

    def has_finished_requests(self) -> bool:
        """Requests finished since the last step, which the worker still holds: a step (even an
        empty one) tells it to drop them."""
        return bool(self.scheduler.finished_req_ids)

    def abort_all(self) -> None:
        self.abort_requests([*self.scheduler.requests, *self._waiting_for_grammar])

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        assert self.structured_output.num_pending == len(self._waiting_for_grammar), "a grammar wait leaked"
        assert not set(self._waiting_for_grammar) & set(self.scheduler.requests)

    def stats(self) -> EngineStats:
        manager = self.kv_cache_manager
        num_total = manager.block_pool.num_blocks
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.num_waiting,
            num_used_blocks=num_total - manager.num_free_blocks,
            num_total_blocks=num_total,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=manager.prefix_cache_queries,
            prefix_cache_hits=manager.prefix_cache_hits,
            lora=self.lora_state,
        )

    def match_prefix(self, block_hashes: Sequence[BlockHash]) -> PrefixMatch:
        """How much of a hash chain this engine holds, and its load (any thread: see
        KVCacheManager.num_matched_blocks)."""
        manager = self.kv_cache_manager
        return PrefixMatch(manager.num_matched_blocks(block_hashes), self.scheduler.num_running,
                           self.num_waiting, manager.num_free_blocks, manager.usage)

    @property
    def num_waiting(self) -> int:
        """Waiting to be scheduled, or for their grammar to compile first."""
        return self.scheduler.num_waiting + len(self._waiting_for_grammar)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def record_cache_snapshot(self) -> None:
        """Between steps (the engine-loop thread): the prefix cache's whole state into `kv_events`."""
        self.kv_cache_manager.record_cache_snapshot()
