"""The batched sampler: one tensor program per step over all rows, vLLM V1's order of operations.

    raw logits ─┬─► log_softmax ──────────────────────────────────────────────────► logprobs (when asked)
                └─► allowed tokens ─► logit bias ─► min_tokens mask ─► penalties ─┬─► argmax ─► greedy rows
                                                                └─► random rows:
        / temperature ─► min-p ─► top-k ─► top-p ─► softmax ─► argmax(probs / q), q ~ Exp(1)

A seeded row's q comes from a generator seeded with `position_seed(seed, position)`, the position being
that of the token drawn: a request resumed elsewhere (its earlier outputs now in its prompt) draws what
it would have drawn uninterrupted, and no batch-mate or preemption moves its randomness.

Logprobs are vLLM's default "raw_logprobs": taken before bias, penalties and temperature. Nothing here
reads a tensor back to the host; `LogprobsTensors.to_host` is the one `.tolist()` at the end of a step.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from services.common.model_runner_output import TokenLogprobs
from services.common.sampling_params import GREEDY_EPSILON
from services.worker.sampling_metadata import ExplicitLogprobs, PenaltyTensors, SamplingMetadata


class LogprobsTensors(NamedTuple):
    """Per row: column 0 is the sampled (or given) token, columns 1..N the top-N of the vocabulary."""

    token_ids: torch.Tensor  # [B, N + 1] int64
    logprobs: torch.Tensor  # [B, N + 1] float32
    ranks: torch.Tensor  # [B] int64; 1 + number of tokens with a strictly higher logprob than column 0

    def to_host(self, num_per_row: list[int]) -> list[TokenLogprobs]:
        """Row i keeps its own top-`num_per_row[i]` (each at most N). Reads the tensors back once."""
        token_ids, logprobs, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        return [TokenLogprobs(token_ids[i][:num + 1], logprobs[i][:num + 1], ranks[i])
                for i, num in enumerate(num_per_row)]


class SamplerOutput(NamedTuple):
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


class Sampler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # One generator per device, re-seeded for each seeded row it fills: it carries no state
        # from one draw to the next, only saves building a generator per row per step.
        self._generators: dict[torch.device, torch.Generator] = {}

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """`logits`: [B, V] float32, one row per request, in the metadata's row order; not modified."""
        if logits.dtype != torch.float32 or logits.dim() != 2:
            raise ValueError(f"expected [num_rows, vocab_size] float32 logits, got {tuple(logits.shape)} "
                             f"{logits.dtype}")
        raw_logprobs = None if meta.max_num_logprobs is None else logits.log_softmax(dim=-1)
        logits = apply_logits_processors(logits, meta)
        sampled = sample(logits, meta, self._generator(logits.device) if meta.seeds else None)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs, meta.explicit_logprobs)
        return SamplerOutput(sampled, logprobs)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, num: int) -> LogprobsTensors:
    """Logprob of each next prompt token (`target_ids[i]` follows position i) and the top-`num`.

    `logits`: [n, V] float32 raw logits of n prompt positions; `target_ids`: [n] int64.
    Makes one [n, V] float32 temporary: a caller with long prompts passes them in chunks.
    """
    return gather_logprobs(logits.log_softmax(dim=-1), target_ids, num)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num: int,
                    explicit: ExplicitLogprobs | None = None) -> LogprobsTensors:
    """Column 0: `token_ids` and their logprobs; columns 1..num: the top-`num` of each row, or for
    the `explicit` rows the logprobs of their own token ids."""
    assert 0 <= num <= logprobs.shape[-1], (num, logprobs.shape)
    token_ids = token_ids.unsqueeze(-1)  # [B, 1]
    token_logprobs = logprobs.gather(-1, token_ids)  # [B, 1]
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1  # [B]
    top_logprobs, top_ids = logprobs.topk(num, dim=-1)  # [B, num]
    if explicit is not None:
        top_ids[explicit.rows] = explicit.token_ids
        top_logprobs[explicit.rows] = logprobs[explicit.rows].gather(-1, explicit.token_ids)
    return LogprobsTensors(token_ids=torch.cat([token_ids, top_ids], dim=-1),
                           logprobs=torch.cat([token_logprobs, top_logprobs], dim=-1),
                           ranks=ranks)


def apply_logits_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Allowed tokens, logit bias, then the min_tokens stop mask, then penalties: they change greedy
    choices too. Returns a new tensor when any applies (the caller's logits stay raw), else `logits`."""
    if (meta.allowed_tokens is None and meta.logit_bias is None and meta.stop_token_mask is None
            and meta.penalties is None):
        return logits
    logits = logits.clone()
    if meta.allowed_tokens is not None:
        restricted_rows, allowed = meta.allowed_tokens  # [R], [R, V]
        logits[restricted_rows] = logits[restricted_rows].masked_fill(~allowed, float("-inf"))
    if meta.logit_bias is not None:
        rows, token_ids, bias = meta.logit_bias
        logits.index_put_((rows, token_ids), bias, accumulate=True)
    if meta.stop_token_mask is not None:
        # After the bias, so a positive bias cannot bring a masked stop token back.
        rows, token_ids, minus_inf = meta.stop_token_mask
        logits.index_put_((rows, token_ids), minus_inf)
    if meta.penalties is not None:
        logits = apply_penalties(logits, meta.penalties)
    return logits


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> torch.Tensor:
    """Repetition over prompt + output tokens (positive logits divided, negative multiplied);
    frequency times the count and presence once per token, over output tokens only."""
    vocab_size = logits.shape[-1]
    output_counts = _bin_counts(penalties.output_token_ids, vocab_size)  # [B, V] float32
    output_seen = output_counts > 0  # [B, V]
    if penalties.prompt_token_ids is not None:
        seen = output_seen | (_bin_counts(penalties.prompt_token_ids, vocab_size) > 0)
        scale = torch.where(seen, penalties.repetition.unsqueeze(1), 1.0)  # [B, V]
        logits = torch.where(logits > 0, logits / scale, logits * scale)
    logits -= penalties.frequency.unsqueeze(1) * output_counts
    logits -= penalties.presence.unsqueeze(1) * output_seen
    return logits


def _bin_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, L] ids padded with vocab_size -> [B, V] float32 occurrence counts (one scatter_add)."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]  # drop the padding bin


def sample(logits: torch.Tensor, meta: SamplingMetadata, generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, V] processed logits -> [B] int64 token ids: argmax for greedy rows, a draw for the rest.
    `generator` (on the logits' device) fills the seeded rows' noise; needed when `meta.seeds` is not empty."""
    greedy = None if meta.all_random else argmax(logits)
    if meta.all_greedy:
        return greedy
    greedy_rows = None if meta.all_random else meta.temperature < GREEDY_EPSILON  # [B] bool
    # Greedy rows divide by 1 here; their draw is thrown away below.
    temperature = meta.temperature if greedy_rows is None else meta.temperature.masked_fill(greedy_rows, 1.0)
    logits = logits / temperature.unsqueeze(1)  # a new tensor: the in-place steps below are safe
    if meta.min_p is not None:
        apply_min_p_(logits, meta.min_p)
    if meta.top_p is not None:
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    elif meta.top_k is not None:
        apply_top_k_(logits, meta.top_k, meta.max_top_k)
    sampled = exponential_race(logits.softmax(dim=-1), meta.seeds, generator)
    return sampled if greedy_rows is None else torch.where(greedy_rows, greedy, sampled)


def argmax(x: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Row-wise argmax of [B, V] (the first index of the maximum, like torch.argmax).

    torch's CPU argmax is a scalar loop, ~10x slower than its vectorized amax; over the vocab that
    was a tenth of a decode step. So: amax per chunk, argmax over the chunk maxima, then argmax
    inside the winning chunk only."""
    b, v = x.shape
    if x.device.type != "cpu" or v % chunk or v == chunk:
        return x.argmax(dim=-1)
    chunks = x.view(b, v // chunk, chunk)
    best = chunks.amax(dim=-1).argmax(dim=-1)  # [B] the first chunk holding the row's maximum
    inside = chunks[torch.arange(b, device=x.device), best].argmax(dim=-1)  # [B]
    return best * chunk + inside


def apply_min_p_(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Mask tokens whose probability is below `min_p` times the row's largest (never the largest)."""
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [B, 1]
    logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """Top-k alone (0 = off) needs no sort: one top-`max_top_k` gives every row its k-th largest."""
    top_values = logits.topk(max_top_k, dim=-1).values  # [B, max_top_k] descending
    kth_largest = top_values.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1))  # [B, 1]
    kth_largest.masked_fill_((top_k == 0).unsqueeze(1), float("-inf"))  # off: keep every token
    logits.masked_fill_(logits < kth_largest, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Top-k (0 = off) then top-p (1 = off), both on one ascending sort of each row (top-p needs it).

        ascending sort:   [ lowest ..................... V-k ........ highest ]
        top-k keeps                                     ^^^^^^^^^^^^^^^^^^^^^  (ties with the k-th too)
        top-p drops the prefix whose cumulative probability is <= 1 - p; the highest token always stays.
    """
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)  # [B, V] ascending
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size)  # [B]
        kth_largest = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))  # [B, 1]
        sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)  # [B, V]
        drop = cumulative <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def exponential_race(probs: torch.Tensor, seeds: dict[int, int],
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row from `probs` [B, V]: argmax(probs / q) with q ~ Exp(1) is a draw from
    probs (the exponential race), with no device sync. Seeded rows (row -> `position_seed`) fill their
    q from `generator` re-seeded for the row, so their draws depend on nothing but that seed; the
    others share one batched fill. (Re-seeding is host-side: on CUDA each fill takes the seed at launch.)"""
    q = torch.empty_like(probs)
    if len(seeds) < probs.shape[0]:
        q.exponential_()
    if seeds:
        assert generator is not None and generator.device == probs.device, "seeded rows need a generator here"
    for row, seed in seeds.items():
        generator.manual_seed(seed)
        q[row].exponential_(generator=generator)
    # exponential_ may return exactly 0, and 0 / 0 is NaN, which argmax would pick.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return argmax(probs.div_(q))
