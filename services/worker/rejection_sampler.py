"""Verifying drafted tokens (speculative decoding): which drafts the target model accepts.

A request that drafted d tokens x_1..x_d computed d + 1 positions this step; the sampler draws one token
t_j at each position j = 0..d, from the target distribution p_j given the context and x_1..x_j (its
penalties, min_tokens and seed position included). The request keeps x_1..x_a and t_a, where a is the
first position whose draw differs from its draft (a = d: every draft accepted, t_d is the bonus token).

That is vLLM's rejection sampling for drafts without probabilities (n-gram), where the draft
distribution q is one-hot at x: accept x with probability min(1, p(x) / q(x)) = p(x), else draw from
the residual max(p - q, 0), which is p without x, renormalised. Drawing t ~ p and accepting when
t == x does both at once: P(accept) = p(x), and a rejected t is distributed as p given t != x. So
every kept token is distributed exactly as without speculation, and a greedy request (t = argmax p)
keeps exactly the tokens it would have produced one step at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def num_accepted_drafts(sampled: np.ndarray, drafts: Sequence[Sequence[int]]) -> np.ndarray:
    """`sampled` [sum(len(d) + 1)]: each request's draws at its positions 0..d, request after request;
    `drafts[i]`: request i's drafted tokens. Returns [len(drafts)] int64: how many drafts each accepts."""
    num_drafts = np.fromiter(map(len, drafts), dtype=np.int64, count=len(drafts))  # [R]
    width = int(num_drafts.max(initial=0))
    if width == 0:
        return num_drafts
    # draws[i, j] = request i's draw at position j < d_i; draft_grid[i, j] = x_{j+1}; padding never matches.
    in_row = np.arange(width)[None, :] < num_drafts[:, None]  # [R, width]
    starts = np.cumsum(num_drafts + 1) - num_drafts - 1  # [R] each request's first draw
    draws = np.full((len(drafts), width), -1, dtype=np.int64)
    draws[in_row] = sampled[(starts[:, None] + np.arange(width)[None, :])[in_row]]
    draft_grid = np.full((len(drafts), width), -2, dtype=np.int64)
    draft_grid[in_row] = np.fromiter((t for d in drafts for t in d), dtype=np.int64, count=int(num_drafts.sum()))
    return np.cumprod(draws == draft_grid, axis=1).sum(axis=1)
