"""Structured outputs in the worker (vLLM's apply_grammar_bitmask): the engine's packed per-step
token masks, applied to the logits before the sampler sees them, so greedy and random rows alike
draw only allowed tokens, and logprobs (taken from these logits) give forbidden tokens -inf."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from services.common.scheduler_output import GrammarBitmask


def unpack_bitmask(bitmask: GrammarBitmask, vocab_size: int) -> np.ndarray:
    """[rows, vocab_size] bool: True where a token may be sampled (tokens past the mask: never)."""
    words = np.frombuffer(bitmask.bitmask, dtype="<i4").reshape(len(bitmask.req_ids), -1)  # [rows, words]
    # Little-endian words viewed as bytes, unpacked low bit first: bit b of word w lands at 32 w + b.
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    if bits.shape[1] < vocab_size:
        bits = np.pad(bits, ((0, 0), (0, vocab_size - bits.shape[1])))
    return bits.astype(bool)


def apply_grammar_bitmask(logits: torch.Tensor, req_ids: Sequence[str], bitmask: GrammarBitmask) -> None:
    """In place: row i of `logits` [len(req_ids), V] is req_ids[i]'s; each of them with a mask row gets
    -inf on every token its grammar forbids. Mask rows of requests not among `req_ids` (not sampled
    here) are ignored."""
    row_of = {req_id: i for i, req_id in enumerate(req_ids)}
    masked = [(row_of[r], k) for k, r in enumerate(bitmask.req_ids) if r in row_of]
    if not masked:
        return
    allowed = unpack_bitmask(bitmask, logits.shape[-1])[[k for _, k in masked]]  # [R, V]
    rows = torch.tensor([i for i, _ in masked], device=logits.device)
    banned = torch.from_numpy(~allowed).to(logits.device)  # [R, V]
    logits[rows] = logits[rows].masked_fill(banned, float("-inf"))
