"""The n-gram proposer (prompt lookup): drafts the tokens that followed an earlier occurrence of the
context's last n tokens. No model, no state: copy-heavy outputs (summaries, edits, code) repeat spans
of their prompt, and those spans are the drafts.

    tokens:  ... a b c d e ... x y a b c | ?          last n = 3 tokens: "a b c"
                 ^^^^^ ^^^                            the match, then the k tokens after it: "d e ..."

One pass of numpy over the context per call: the candidate ends are the earlier positions holding the
last token; each is extended backwards up to `max_n` tokens at once (one comparison per n, not per
candidate). The longest match wins (at least `min_n`), among equals the latest.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, num_speculative_tokens: int) -> None:
        assert 1 <= min_n <= max_n and num_speculative_tokens >= 1
        self.min_n = min_n
        self.max_n = max_n
        self.k = num_speculative_tokens

    def propose(self, tokens: np.ndarray, max_tokens: int | None = None) -> np.ndarray:
        """Up to min(k, max_tokens) drafted ids following `tokens` [L] int64 (empty: no match)."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        length = len(tokens)
        if k <= 0 or length <= self.min_n:
            return tokens[:0]
        # Candidate match ends e < L - 1: tokens[e] == the last token and a token follows it.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # [C]
        if not len(ends):
            return tokens[:0]
        max_n = min(self.max_n, length - 1)
        # matched[c, j]: tokens[ends[c] - j] == tokens[L - 1 - j]; a match of n needs j < n all True.
        offsets = np.arange(max_n)  # [max_n]
        before = ends[:, None] - offsets[None, :]  # [C, max_n]
        matched = (before >= 0) & (tokens[np.maximum(before, 0)] == tokens[length - 1 - offsets][None, :])
        match_len = np.cumprod(matched, axis=1).sum(axis=1)  # [C] leading run of matches
        best = int(match_len.max())
        if best < self.min_n:
            return tokens[:0]
        end = int(ends[np.flatnonzero(match_len == best)[-1]])  # the latest of the longest
        return tokens[end + 1 : end + 1 + k]
