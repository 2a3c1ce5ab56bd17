"""The attention layer models call: q, k, v in; the step's K/V written to the paged cache and
attention over each request's context out. Which backend runs is the forward context's choice."""

from __future__ import annotations

import torch
from torch import nn

from services.worker.forward_context import get_forward_context


class Attention(nn.Module):
    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, "GQA needs num_heads divisible by num_kv_heads"
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [num_tokens, num_heads * head_size]; k, v: [num_tokens, num_kv_heads * head_size]
        ctx = get_forward_context()
        n = q.shape[0]
        out = ctx.backend.forward(
            self,
            q.view(n, self.num_heads, self.head_size),
            k.view(n, self.num_kv_heads, self.head_size),
            v.view(n, self.num_kv_heads, self.head_size),
            ctx.kv_caches[self.layer_idx],
            ctx.plan,
        )
        return out.view(n, self.num_heads * self.head_size)
