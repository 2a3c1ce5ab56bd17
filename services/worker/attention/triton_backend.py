"""Paged attention with the Triton kernels: per layer, one KV write and one attention launch.

`plan()` runs once per step: it puts the metadata on the device as the kernels read it (int32,
contiguous) without a host sync; every layer's `forward()` then writes the step's K/V into its
cache (`reshape_and_cache`) and attends the whole mixed batch of prefill chunks and decodes in one
launch (`paged_attention`, which picks the split-KV decode path by itself for small decode-only
batches with long contexts). Cache layout: services/worker/kv_cache.py.

Runs on CUDA, or on the CPU when TRITON_INTERPRET=1 was set before the kernels were imported (the
tests); services/worker/attention/backend.py imports this module only when it is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh_kernels.paged_attention import AttentionParams, PagedBatch, check_supported, paged_attention
from kvmesh_kernels.reshape_and_cache import reshape_and_cache
from services.worker.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class TritonAttentionPlan:
    slot_mapping: torch.Tensor  # [num_tokens] int64 on the device; -1 = padding
    batch: PagedBatch


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, device: torch.device) -> None:
        # Fail at start-up, not in the first forward: a CPU without the interpreter cannot run these.
        check_supported(device)
        self.device = device

    def plan(self, meta: AttentionMetadata) -> TritonAttentionPlan:
        def on_device(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return t.to(self.device, dtype, non_blocking=True).contiguous()

        batch = PagedBatch(
            query_start_loc=on_device(meta.query_start_loc, torch.int32),
            seq_lens=on_device(meta.seq_lens, torch.int32),
            block_table=on_device(meta.block_table, torch.int32),
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
        )
        return TritonAttentionPlan(on_device(meta.slot_mapping, torch.int64), batch)

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, plan: TritonAttentionPlan) -> torch.Tensor:
        # q: [num_tokens, H, D]; k, v: [num_tokens, Hkv, D]; kv_cache: [2, num_blocks, block_size, Hkv, D]
        reshape_and_cache(k, v, kv_cache, plan.slot_mapping)
        out = torch.empty_like(q)  # [num_tokens, H, D]
        params = AttentionParams(layer.scale, layer.sliding_window, layer.logits_soft_cap)
        paged_attention(q, kv_cache, out, plan.batch, params)
        return out
