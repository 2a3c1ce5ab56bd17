"""Sampling metadata: one step's `SamplingParams`, as one tensor per field in batch row order.

Built once per step by the model runner from host lists (`SamplingMetadata.build`); the sampler then
runs one batched tensor program over it. A field that no row of the batch uses is `None`, so the
sampler skips its work entirely (the all-greedy step is one argmax).

What a request's token-id lists say (allowed ids, logit bias, stop ids) is turned into tensors once,
when it joins the batch (`RequestSamplingTensors`); a step only stacks and concatenates those, so its
cost does not grow with the lists' lengths, and one request's long list does not slow its batch-mates.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from services.common.sampling_params import GREEDY_EPSILON, SamplingParams


MASK64 = (1 << 64) - 1
GOLDEN64 = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: splitmix64's increment


def splitmix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers that spreads every input bit."""
    x = (x + GOLDEN64) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """The generator seed, in [0, 2^64), for the token at absolute `position` (the number of tokens
    before it, prompt and outputs) of a request seeded `seed` (any int). Hashed twice, so that nearby
    seeds (the processor gives choice i seed + i) and nearby positions never share a stream."""
    return splitmix64(splitmix64(seed & MASK64) ^ (position & MASK64))


class TokenEntries(NamedTuple):
    """Sparse entries `(rows[i], token_ids[i])` of a [num_rows, vocab_size] logits tensor."""

    rows: torch.Tensor  # [K] int64
    token_ids: torch.Tensor  # [K] int64
    values: torch.Tensor  # [K] float32


class PenaltyTensors(NamedTuple):
    """Presence, frequency and repetition penalties of every row (neutral values where unused)."""

    presence: torch.Tensor  # [B] float32; 0 = off
    frequency: torch.Tensor  # [B] float32; 0 = off
    repetition: torch.Tensor  # [B] float32; 1 = off
    # Only rows with a penalty carry their tokens; other rows are all padding (= vocab_size).
    output_token_ids: torch.Tensor  # [B, max_num_outputs] int64, padded with vocab_size
    # None exactly when no row has a repetition penalty (the only penalty that counts the prompt).
    prompt_token_ids: torch.Tensor | None  # [B, max_prompt_len] int64, padded with vocab_size


class AllowedTokens(NamedTuple):
    """The rows that may sample only some tokens, and which tokens, as one mask row each."""

    restricted_rows: torch.Tensor  # [R] int64
    allowed: torch.Tensor  # [R, V] bool; True where restricted_rows[i] may sample


class RequestSamplingTensors(NamedTuple):
    """One request's token-indexed sampling state, on the logits' device, built once when it joins the
    worker's batch (`of`). Each field is None when the request does not use it."""

    allowed: torch.Tensor | None  # [V] bool: the tokens it may sample (allowed_token_ids)
    bias_token_ids: torch.Tensor | None  # [K] int64: logit_bias's keys, each once
    bias_values: torch.Tensor | None  # [K] float32: their biases
    # EOS and stop ids, masked to -inf while it has fewer than min_tokens outputs; None without min_tokens.
    min_tokens_stop_ids: torch.Tensor | None  # [S] int64

    @classmethod
    def of(cls, params: SamplingParams, stop_token_ids: Set[int], vocab_size: int,
           device: torch.device) -> RequestSamplingTensors:
        """ValueError for an id outside the vocabulary, in any list (`stop_token_ids` holds EOS and the
        request's stop ids). O(list lengths), once per request."""
        allowed = None
        if params.allowed_token_ids is not None:
            ids = _checked_ids(params.allowed_token_ids, vocab_size, "allowed_token_ids")
            allowed = torch.zeros(vocab_size, dtype=torch.bool)
            allowed[ids] = True
            allowed = _to_device(allowed, device)
        bias_token_ids = bias_values = None
        if params.logit_bias:
            bias_token_ids = _to_device(_checked_ids(params.logit_bias.keys(), vocab_size, "logit_bias"), device)
            bias_values = _to_device(torch.tensor(list(params.logit_bias.values()), dtype=torch.float32), device)
        stop_ids = _checked_ids(stop_token_ids, vocab_size, "stop token")
        return cls(allowed=allowed, bias_token_ids=bias_token_ids, bias_values=bias_values,
                   min_tokens_stop_ids=_to_device(stop_ids, device) if params.min_tokens and len(stop_ids) else None)


class ExplicitLogprobs(NamedTuple):
    """Rows that asked for the logprobs of given tokens (vLLM's logprob_token_ids) instead of their top-N."""

    rows: torch.Tensor  # [R] int64
    token_ids: torch.Tensor  # [R, max_num_logprobs] int64; a row's ids first, padded with 0 (cut on the host)


@dataclass(slots=True)
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32; 0 for greedy rows
    all_greedy: bool
    all_random: bool
    # Off (None) unless some random row uses them; greedy rows are always off.
    top_k: torch.Tensor | None  # [B] int64; 0 = off; below vocab_size
    max_top_k: int  # the largest top_k over rows, known on the host; 0 exactly when top_k is None
    top_p: torch.Tensor | None  # [B] float32; 1 = off
    min_p: torch.Tensor | None  # [B] float32; 0 = off
    # Row -> position_seed(its seed, the position of the token it draws now), for seeded random rows
    # only: a seeded request's draws depend on nothing but its seed and its length, whatever its
    # batch-mates, preemptions, or the engine it was resumed on.
    seeds: dict[int, int]
    penalties: PenaltyTensors | None  # None when no row has any penalty
    logit_bias: TokenEntries | None  # values are the biases, added to the logits
    # Stop tokens (EOS included, even with ignore_eos) of rows that have fewer than min_tokens
    # outputs; values are -inf, written over the logits.
    stop_token_mask: TokenEntries | None
    allowed_tokens: AllowedTokens | None  # None when no row restricts its tokens
    max_num_logprobs: int | None  # the largest top-N over rows; None when no row wants logprobs
    explicit_logprobs: ExplicitLogprobs | None  # None when no row names its logprob tokens

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]],
        stop_token_ids_per_row: Sequence[Set[int]],
        vocab_size: int,
        device: torch.device,
        request_tensors: Sequence[RequestSamplingTensors] | None = None,
    ) -> SamplingMetadata:
        """`stop_token_ids_per_row[i]` is row i's EOS ids plus its `stop_token_ids`. Row i draws the token
        at position len(prompt_token_ids[i]) + len(output_token_ids[i]). `request_tensors[i]` is row i's
        RequestSamplingTensors, kept from when it joined the batch; None: built here from the params."""
        device = torch.device(device)
        num_rows = len(params)
        if not len(output_token_ids) == len(prompt_token_ids) == len(stop_token_ids_per_row) == num_rows:
            raise ValueError("params, output_token_ids, prompt_token_ids and stop_token_ids_per_row "
                             "must have one entry per batch row")
        if request_tensors is None:
            request_tensors = [RequestSamplingTensors.of(p, stops, vocab_size, device)
                               for p, stops in zip(params, stop_token_ids_per_row)]
        elif len(request_tensors) != num_rows:
            raise ValueError("request_tensors must have one entry per batch row")
        greedy = [p.temperature < GREEDY_EPSILON for p in params]
        random_params = [None if g else p for p, g in zip(params, greedy)]
        # top_k >= vocab_size keeps everything: treat it as off.
        top_k = [0 if p is None or p.top_k >= vocab_size else p.top_k for p in random_params]
        top_p = [1.0 if p is None else p.top_p for p in random_params]
        min_p = [0.0 if p is None else p.min_p for p in random_params]
        logprobs = [p.num_logprobs for p in params if p.num_logprobs is not None]
        max_num_logprobs = max(logprobs) if logprobs else None
        return cls(
            temperature=_to_device(torch.tensor([0.0 if p is None else p.temperature for p in random_params],
                                                dtype=torch.float32), device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=_to_device(torch.tensor(top_k, dtype=torch.int64), device) if any(top_k) else None,
            max_top_k=max(top_k, default=0),
            top_p=_to_device(torch.tensor(top_p, dtype=torch.float32), device) if min(top_p, default=1.0) < 1.0
            else None,
            min_p=_to_device(torch.tensor(min_p, dtype=torch.float32), device) if any(min_p) else None,
            seeds={row: position_seed(p.seed, len(prompt) + len(outputs))
                   for row, (p, prompt, outputs) in enumerate(zip(params, prompt_token_ids, output_token_ids))
                   if p.seed is not None and not greedy[row]},
            penalties=_penalty_tensors(params, output_token_ids, prompt_token_ids, vocab_size, device),
            logit_bias=_logit_bias(request_tensors, device),
            stop_token_mask=_stop_token_mask(params, output_token_ids, request_tensors, device),
            allowed_tokens=_allowed_tokens(request_tensors, device),
            max_num_logprobs=max_num_logprobs,
            explicit_logprobs=_explicit_logprobs(params, max_num_logprobs or 0, vocab_size, device),
        )


def _penalty_tensors(params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]],
                     prompt_token_ids: Sequence[Sequence[int]], vocab_size: int,
                     device: torch.device) -> PenaltyTensors | None:
    uses = [p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0 for p in params]
    if not any(uses):
        return None
    any_repetition = any(p.repetition_penalty != 1.0 for p in params)
    return PenaltyTensors(
        presence=_to_device(torch.tensor([p.presence_penalty for p in params], dtype=torch.float32), device),
        frequency=_to_device(torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32), device),
        repetition=_to_device(torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32), device),
        output_token_ids=_pad_rows([_penalized_outputs(p, prompt, ids) if u else ()
                                    for p, prompt, ids, u in zip(params, prompt_token_ids, output_token_ids, uses)],
                                   vocab_size, device),
        prompt_token_ids=_pad_rows([ids if p.repetition_penalty != 1.0 else () for ids, p in
                                    zip(prompt_token_ids, params)], vocab_size, device) if any_repetition else None,
    )


def _penalized_outputs(params: SamplingParams, prompt: Sequence[int], outputs: Sequence[int]) -> Sequence[int]:
    """The tokens frequency and presence penalties count: a migrated request's earlier outputs (the
    end of its prompt) and the ones generated here."""
    if not params.num_resumed_outputs:
        return outputs
    return [*prompt[len(prompt) - params.num_resumed_outputs:], *outputs]


def _logit_bias(tensors: Sequence[RequestSamplingTensors], device: torch.device) -> TokenEntries | None:
    rows = [row for row, t in enumerate(tensors) if t.bias_token_ids is not None]
    if not rows:
        return None
    return TokenEntries(rows=_repeat_rows(rows, [tensors[row].bias_token_ids for row in rows], device),
                        token_ids=torch.cat([tensors[row].bias_token_ids for row in rows]),
                        values=torch.cat([tensors[row].bias_values for row in rows]))


def _allowed_tokens(tensors: Sequence[RequestSamplingTensors], device: torch.device) -> AllowedTokens | None:
    restricted = [row for row, t in enumerate(tensors) if t.allowed is not None]
    if not restricted:
        return None
    return AllowedTokens(restricted_rows=_to_device(torch.tensor(restricted, dtype=torch.int64), device),
                         allowed=torch.stack([tensors[row].allowed for row in restricted]))


def _explicit_logprobs(params: Sequence[SamplingParams], width: int, vocab_size: int,
                       device: torch.device) -> ExplicitLogprobs | None:
    rows = [row for row, p in enumerate(params) if p.logprob_token_ids is not None]
    if not rows:
        return None
    ids = [params[row].logprob_token_ids for row in rows]
    _checked_ids((t for row_ids in ids for t in row_ids), vocab_size, "logprob_token_ids")
    return ExplicitLogprobs(rows=_to_device(torch.tensor(rows, dtype=torch.int64), device),
                            token_ids=_pad_rows(ids, 0, device, width))


def _stop_token_mask(params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]],
                     tensors: Sequence[RequestSamplingTensors], device: torch.device) -> TokenEntries | None:
    rows = [row for row, (p, outputs, t) in enumerate(zip(params, output_token_ids, tensors))
            if t.min_tokens_stop_ids is not None and len(outputs) < p.min_tokens]
    if not rows:
        return None
    token_ids = torch.cat([tensors[row].min_tokens_stop_ids for row in rows])
    return TokenEntries(rows=_repeat_rows(rows, [tensors[row].min_tokens_stop_ids for row in rows], device),
                        token_ids=token_ids, values=torch.full_like(token_ids, float("-inf"), dtype=torch.float32))


def _repeat_rows(rows: list[int], entries: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[K] int64: rows[i] once per element of entries[i] (their lengths are known on the host)."""
    counts = torch.tensor([len(e) for e in entries], dtype=torch.int64)
    return _to_device(torch.tensor(rows, dtype=torch.int64).repeat_interleave(counts), device)


def _checked_ids(token_ids: Iterable[int], vocab_size: int, what: str) -> torch.Tensor:
    """[K] int64 host tensor of `token_ids`; ValueError naming (up to 8 of) those outside the vocabulary."""
    try:
        ids = torch.from_numpy(np.fromiter(token_ids, dtype=np.int64))
    except OverflowError:  # an int beyond int64 (only in-process callers can build one)
        raise ValueError(f"{what} token ids must be in the vocabulary [0, {vocab_size})") from None
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if len(bad):
        raise ValueError(f"{what} token ids {bad.unique()[:8].tolist()} are outside the vocabulary [0, {vocab_size})")
    return ids


def _pad_rows(rows: Sequence[Sequence[int]], pad: int, device: torch.device, width: int = 0) -> torch.Tensor:
    """Right-pad ragged rows with `pad` into one [len(rows), max(longest, width)] int64 tensor."""
    out = np.full((len(rows), max(width, max((len(r) for r in rows), default=0))), pad, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return _to_device(torch.from_numpy(out), device)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to `device`. On CUDA it goes through pinned memory, so the copy is
    asynchronous and does not wait for the model forward already queued on the stream."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
