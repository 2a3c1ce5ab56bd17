"""The model runner: applies the step's diff to the persistent batch, builds the flat inputs,
runs the model with paged attention, samples, and returns the new tokens.

In a tensor-parallel group every rank runs the same steps on its own copy of the persistent batch;
rank 0 (the driver) gets the whole logits, samples, and sends the sampled ids to the other ranks
(one broadcast of a few int64 per step), which append them to their batch and return no tokens."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from services.common.model_runner_output import ModelRunnerOutput, TokenLogprobs
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import NewRequestData, SchedulerOutput
from services.worker.attention import AttentionBackend, AttentionMetadata
from services.worker.forward_context import ForwardContext, set_forward_context
from services.worker.grammar_bitmask import apply_grammar_bitmask
from services.worker.input_batch import CachedRequestState, InputBatch, flat_ranges
from services.worker.lora.manager import LoRAManager
from services.worker.parallel_group import TensorParallelGroup
from services.worker.rejection_sampler import num_accepted_drafts
from services.worker.sampler import Sampler, compute_prompt_logprobs, gather_logprobs
from services.worker.sampling_metadata import RequestSamplingTensors, SamplingMetadata


class SampledTokens(NamedTuple):
    token_ids: list[int]  # one per sampled row
    logprobs: list[TokenLogprobs] | None  # aligned with token_ids when any row asked


class AcceptedTokens(NamedTuple):
    kept: list[int]  # the draws that became tokens, in order
    new_tokens: list[list[int]]  # per surviving request: its accepted drafts, then its sampled token
    num_accepted: np.ndarray  # [surviving requests] int64


class SampleRows(NamedTuple):
    """The sampler's rows of a step: one per draw, a request with d drafts having d + 1 in a row. Draw j
    of such a request sees its outputs followed by its first j drafts (penalties, min_tokens and the
    seed's position count them, as if those drafts had been sampled already)."""

    states: list[CachedRequestState]
    output_token_ids: list[list[int]]

    @classmethod
    def of(cls, states: list[CachedRequestState], drafts: list[list[int]]) -> SampleRows:
        if not any(drafts):
            return cls(states, [s.output_token_ids for s in states])
        return cls([s for s, d in zip(states, drafts) for _ in range(len(d) + 1)],
                   [[*s.output_token_ids, *d[:j]] for s, d in zip(states, drafts) for j in range(len(d) + 1)])

    def row(self, i: int) -> SampleRows:
        return SampleRows(self.states[i : i + 1], self.output_token_ids[i : i + 1])


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        block_size: int,
        max_num_reqs: int,
        max_model_len: int,
        vocab_size: int,
        tp: TensorParallelGroup | None = None,
        lora: LoRAManager | None = None,
    ) -> None:
        """`lora`: the adapters' state when LoRA is on (its layers already around the model's)."""
        self.model = model
        self.lora = lora
        self.tp = tp or TensorParallelGroup()
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = kv_caches[0].device
        self.batch = InputBatch(max_num_reqs, max_model_len, block_size)
        self.sampler = Sampler()
        # The sampled rows' logits, kept from step to step on a CPU: fresh, a 262k vocabulary's at 32 rows
        # (34 MB) came as new pages each step, and faulting them in took a tenth of the step.
        self._logits: torch.Tensor | None = None

    def _apply_diff(self, out: SchedulerOutput) -> dict[str, str]:
        """Returns the new requests refused (id -> why): they fail alone, the step goes on without them."""
        failed: dict[str, str] = {}
        # Sorted: a removal moves the last row into the hole, so the order of removals decides the
        # rows, and the ranks of a tensor-parallel group must lay out the batch alike (their
        # all-reduces add up token by token). A set's order differs between processes.
        for req_id in sorted(out.finished_req_ids):
            self.batch.remove(req_id)
        for lora_id in out.removed_lora_ids:  # after their last requests left the batch
            if self.lora is not None:
                self.lora.remove(lora_id)
        for new in out.scheduled_new_reqs:
            try:
                self._add(new)
            except ValueError as exc:
                failed[new.req_id] = f"request {new.req_id}: {exc}"
        for cached in out.scheduled_cached_reqs:
            row = self.batch.row_of[cached.req_id]
            assert self.batch.num_computed_tokens[row] == cached.num_computed_tokens, (
                f"{cached.req_id}: worker has {self.batch.num_computed_tokens[row]} computed tokens, "
                f"engine says {cached.num_computed_tokens}")
            self.batch.append_blocks(row, cached.new_block_ids)
        return failed

    def _add(self, new: NewRequestData) -> None:
        check_sampling_values(new.sampling_params)
        # Its token-id lists become tensors here, once (ValueError for an id outside the vocabulary):
        # each step then costs the same whatever their lengths.
        tensors = RequestSamplingTensors.of(new.sampling_params, new.stop_token_ids, self.vocab_size, self.device)
        if new.lora_request is not None:
            if self.lora is None:
                raise ValueError(f"LoRA adapter {new.lora_request.lora_name!r} asked of a worker without LoRA: "
                                 "start it with --enable-lora")
            self.lora.add(new.lora_request)
        self.batch.add(new, tensors)

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        failed = self._apply_diff(out)
        num_scheduled_tokens = out.num_scheduled_tokens
        if failed:
            num_scheduled_tokens = {r: n for r, n in num_scheduled_tokens.items() if r not in failed}
        if not num_scheduled_tokens:
            return ModelRunnerOutput([], [], failed=failed)
        batch = self.batch
        bs = self.block_size

        # Scheduled requests in row order; token j of request i is at flat index starts[i] + j.
        rows = np.fromiter((batch.row_of[r] for r in num_scheduled_tokens), dtype=np.int64)
        q_lens = np.fromiter(num_scheduled_tokens.values(), dtype=np.int64)
        spec = out.scheduled_spec_decode_tokens
        num_drafts = np.fromiter((len(spec.get(r, ())) for r in num_scheduled_tokens), dtype=np.int64)
        # With LoRA, the rows of each adapter side by side: the step's mapping makes them one segment, so
        # the LoRA kernels read an adapter's weights once for all its rows, not once a request.
        order = np.argsort(rows, kind="stable") if self.lora is None else np.lexsort((rows, batch.lora_ids[rows]))
        rows, q_lens, num_drafts = rows[order], q_lens[order], num_drafts[order]
        if spec:  # drafted tokens sit after a row's known tokens, for this step's inputs only
            batch.write_drafts(spec)
        ends = np.cumsum(q_lens)
        starts = ends - q_lens
        computed = batch.num_computed_tokens[rows]
        seq_lens = computed + q_lens
        num_tokens = int(ends[-1])
        token_rows = np.repeat(rows, q_lens)
        positions = np.repeat(computed - starts, q_lens) + np.arange(num_tokens)  # [num_tokens]
        assert (seq_lens <= batch.num_tokens[rows] + num_drafts).all(), "scheduled past the known tokens"

        positions_t = torch.from_numpy(positions)
        token_rows_t = torch.from_numpy(token_rows)
        input_ids = batch.token_ids[token_rows_t, positions_t]
        slot_mapping = batch.block_table[token_rows_t, positions_t // bs].long() * bs + positions_t % bs
        max_seq_len = int(seq_lens.max())
        meta = AttentionMetadata(
            num_tokens=num_tokens,
            num_reqs=len(rows),
            query_start_loc=torch.from_numpy(np.concatenate(([0], ends))).int(),
            seq_lens=torch.from_numpy(seq_lens).int(),
            positions=positions_t,
            slot_mapping=slot_mapping,
            block_table=batch.block_table[torch.from_numpy(rows), : -(-max_seq_len // bs)],
            block_size=bs,
            max_query_len=int(q_lens.max()),
            max_seq_len=max_seq_len,
            query_lens_cpu=q_lens.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        lora = None if self.lora is None else self.lora.mapping(batch.lora_ids[rows], meta.query_start_loc)
        context = ForwardContext(meta, self.backend.plan(meta), self.kv_caches, self.backend, lora)
        with set_forward_context(context):
            hidden = self.model(input_ids.to(self.device), positions_t.to(self.device))  # [num_tokens, hidden]

        prompt_logprobs = self._prompt_logprobs(hidden, rows, starts, computed, q_lens)
        batch.num_computed_tokens[rows] = seq_lens

        # Only requests whose scheduled tokens reach their last known token (and drafts) sample;
        # partial prefills are not sampled at all. A request with d drafts samples at its last d + 1
        # positions: the draws that verify its drafts (services/worker/rejection_sampler.py).
        done = seq_lens == batch.num_tokens[rows] + num_drafts
        sample_rows = rows[done]
        if not len(sample_rows):
            return ModelRunnerOutput([], [], prompt_logprobs=prompt_logprobs, failed=failed)
        num_draws = num_drafts[done] + 1  # [R]
        draw_index = flat_ranges(ends[done] - num_draws, num_draws)  # [draws] flat index of each draw's position
        logits = self._compute_logits(hidden[torch.from_numpy(draw_index)])  # [draws, vocab]; None off rank 0
        states = [batch.states[r] for r in sample_rows.tolist()]
        drafts = [spec.get(s.req_id, []) for s in states]
        if logits is None:
            return self._follow_driver(sample_rows, states, drafts, prompt_logprobs, failed)
        draws = SampleRows.of(states, drafts)
        if out.grammar_bitmask is not None:  # structured outputs: forbidden tokens to -inf, before sampling
            apply_grammar_bitmask(logits, [s.req_id for s in draws.states], out.grammar_bitmask)
        try:
            token_ids, logprobs = self._sample(logits, draws)
        except (ValueError, RuntimeError):  # torch's own errors are RuntimeErrors
            # One row's parameters broke the batched sampler: sample row by row, fail the culprits.
            token_ids, logprobs = self._sample_each(logits, draws, failed)
        if self.tp.size > 1:  # the other ranks verify the same draws; -1: a row that failed sampling
            self.tp.broadcast_tokens(token_ids, len(token_ids))
        kept, new_tokens, num_accepted = self._accept(sample_rows, states, drafts, token_ids, failed)
        if logprobs is not None:  # the kept draws' logprobs, in the order of the kept tokens
            logprobs = [logprobs[i] for i in kept]
        states = [s for s in states if s.req_id not in failed]
        return ModelRunnerOutput(
            req_ids=[s.req_id for s in states],
            sampled_token_ids=[tokens[-1] for tokens in new_tokens],
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            failed=failed,
            num_accepted_drafts=num_accepted.tolist() if spec else [],
        )

    def _accept(self, sample_rows: np.ndarray, states: list[CachedRequestState], drafts: list[list[int]],
                token_ids: list[int], failed: dict[str, str]) -> AcceptedTokens:
        """Verify the drafts against the draws (one per position, -1 where sampling failed), append each
        surviving row's new tokens to the batch and take back the KV of its rejected drafts."""
        batch = self.batch
        draws = np.asarray(token_ids, dtype=np.int64)
        num_accepted = num_accepted_drafts(draws, drafts)  # [R]
        num_draws = np.fromiter(map(len, drafts), dtype=np.int64, count=len(drafts)) + 1
        firsts = np.cumsum(num_draws) - num_draws
        ok = np.array([s.req_id not in failed for s in states], dtype=bool)
        rows, num_accepted = sample_rows[ok], num_accepted[ok]
        kept = flat_ranges(firsts[ok], num_accepted + 1)  # the draws kept: each surviving row's first a + 1
        new_tokens = batch.append_tokens(rows, draws[kept], num_accepted + 1)
        batch.num_computed_tokens[rows] -= num_draws[ok] - 1 - num_accepted
        return AcceptedTokens(kept.tolist(), new_tokens, num_accepted)

    def _follow_driver(self, sample_rows: np.ndarray, states: list[CachedRequestState], drafts: list[list[int]],
                       prompt_logprobs: dict[str, list[TokenLogprobs]], failed: dict[str, str]) -> ModelRunnerOutput:
        """A rank other than 0: take the driver's draws, verify them as it does, and append the same
        tokens to this rank's batch. Its output names the same requests in the same order, without
        tokens (the engine reads rank 0's)."""
        num_draws = sum(map(len, drafts)) + len(drafts)
        token_ids = self.tp.broadcast_tokens(None, num_draws)
        failed_here = dict(failed)
        firsts = np.cumsum([len(d) + 1 for d in drafts]) - [len(d) + 1 for d in drafts]
        for state, first, draft in zip(states, firsts.tolist(), drafts):
            if min(token_ids[first : first + len(draft) + 1]) < 0:
                failed_here[state.req_id] = "sampling failed on the driver"
        self._accept(sample_rows, states, drafts, token_ids, failed_here)
        return ModelRunnerOutput([s.req_id for s in states if s.req_id not in failed_here], [],
                                 prompt_logprobs=prompt_logprobs, failed=failed)

    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The model's logits for the rows to sample, in the kept buffer where there is one: they live
        only until the step's tokens are drawn. A larger batch than any before gets a new buffer."""
        if self.device.type != "cpu" or self.tp.size > 1:  # GPUs cache their allocations
            return self.model.compute_logits(hidden)
        n = hidden.shape[0]
        if self._logits is not None and self._logits.shape[0] >= n:
            return self.model.compute_logits(hidden, out=self._logits[:n])
        self._logits = self.model.compute_logits(hidden)
        return self._logits

    def _sample(self, logits: torch.Tensor, draws: SampleRows) -> SampledTokens:
        """One batched sampler call over `logits` [len(draws.states), vocab], row i being draw i."""
        states = draws.states
        meta = SamplingMetadata.build(
            params=[s.sampling_params for s in states],
            output_token_ids=draws.output_token_ids,
            prompt_token_ids=[s.prompt_token_ids for s in states],
            stop_token_ids_per_row=[s.stop_token_ids for s in states],
            vocab_size=self.vocab_size,
            device=logits.device,
            request_tensors=[s.sampling_tensors for s in states],
        )
        sampled = self.sampler(logits, meta)
        logprobs = None
        if sampled.logprobs is not None:
            logprobs = sampled.logprobs.to_host([s.sampling_params.num_logprobs or 0 for s in states])
        return SampledTokens(sampled.sampled_token_ids.tolist(), logprobs)

    def _sample_each(self, logits: torch.Tensor, draws: SampleRows, failed: dict[str, str]) -> SampledTokens:
        """The slow path after a failed batched call: each row alone; a row that fails again fails its
        request (`failed`) and draws -1. (A seeded row draws the same again: its noise is keyed by its
        seed and position.)"""
        token_ids: list[int] = []
        logprobs: list[TokenLogprobs] = []
        for i, state in enumerate(draws.states):
            try:
                one = self._sample(logits[i : i + 1], draws.row(i))
            except (ValueError, RuntimeError) as exc:
                failed[state.req_id] = f"request {state.req_id}: sampling failed ({type(exc).__name__})"
                token_ids.append(-1)
                logprobs.append(TokenLogprobs([-1], [float("nan")], 0))
                continue
            token_ids += one.token_ids
            # As the batched call: when any row asks for logprobs, every row has its sampled token's.
            logprobs += one.logprobs or gather_logprobs(
                logits[i : i + 1].log_softmax(dim=-1), torch.tensor(one.token_ids, device=logits.device), 0
            ).to_host([0])
        any_logprobs = any(s.sampling_params.num_logprobs is not None for s in draws.states)
        return SampledTokens(token_ids, logprobs if any_logprobs else None)

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: np.ndarray, starts: np.ndarray,
                         computed: np.ndarray, q_lens: np.ndarray) -> dict[str, list[TokenLogprobs]]:
        """Logprobs of each prompt token given the ones before it, for the positions computed now.
        Position p's logits predict token p + 1, so the last prompt position yields none."""
        result: dict[str, list[TokenLogprobs]] = {}
        for i, row in enumerate(rows.tolist()):
            state = self.batch.states[row]
            num = state.sampling_params.prompt_logprobs
            if num is None:
                continue
            first = int(computed[i])
            last = min(first + int(q_lens[i]), len(state.prompt_token_ids) - 1)
            if first >= last:
                continue
            logits = self.model.compute_logits(hidden[starts[i] : starts[i] + last - first])
            if logits is None:  # not the driver: it took part in the gather, rank 0 computes the logprobs
                continue
            targets = self.batch.token_ids[row, first + 1 : last + 1].to(logits.device)
            result[state.req_id] = compute_prompt_logprobs(logits, targets, num).to_host([num] * (last - first))
        return result



def check_sampling_values(params: SamplingParams) -> None:
    """ValueError for a number the sampler cannot compute with: a NaN or infinite temperature,
    top-p, min-p, penalty or bias turns a row's logits into NaN (garbage tokens, or a raising
    sampler that would fail every request of the step). The engine checks its callers' requests
    too; this is the worker's own guard, which fails that request alone."""
    values = [params.temperature, params.top_p, params.min_p, params.presence_penalty, params.frequency_penalty,
              params.repetition_penalty, *(params.logit_bias or {}).values()]
    if not all(math.isfinite(v) for v in values):
        raise ValueError("sampling parameters must be finite numbers")
