"""Choosing an attention backend: `auto` is Triton on CUDA; on the CPU it is `cpu` (the torch
backend's plan with the native paged attention kernel: every token of a step, decodes and prefill
chunks, in one call) when a C compiler can build that kernel, else `torch`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

import torch

from kvmesh_kernels import cpu_fused_ops, cpu_paged_attention
from services.common.config import default_cache_dir
from services.worker.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    name: str

    def plan(self, meta: AttentionMetadata) -> Any: ...

    def forward(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, plan: Any) -> torch.Tensor: ...


from services.worker.attention.torch_backend import TorchAttentionBackend


def get_attention_backend(name: str, device: torch.device, cache_dir: Path | None = None,
                          prefill_bf16: bool = False) -> AttentionBackend:
    """`cache_dir` (default: `default_cache_dir()`) keeps the native CPU kernel's build. `prefill_bf16`
    (`--dtype auto` or `bfloat16`): the `cpu` backend multiplies prompt chunks' attention in bfloat16
    where its build has the instructions (cpu_paged_attention.prefill_bf16_built)."""
    cache_dir = cache_dir or default_cache_dir()
    if name == "auto":
        if device.type == "cuda":
            name = "triton"
        else:
            name = "cpu" if cpu_paged_attention.is_available(cache_dir) else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("the cpu attention backend runs on the CPU only")
        cpu_paged_attention.build(cache_dir)  # fails here, with the compiler's message, not mid-step
        cpu_fused_ops.available(cache_dir)  # its one-call KV write (else two index_copy_)
        prefill_bf16 = prefill_bf16 and cpu_paged_attention.prefill_bf16_built()
        if prefill_bf16:
            logger.info("prompt chunks' attention multiplies in bfloat16 (AVX512_BF16)")
        return TorchAttentionBackend(native_decode=True, prefill_bf16=prefill_bf16)
    if name == "triton":
        # Imported here, not at the top: importing the kernels fixes Triton's compiled-or-interpreted
        # choice for the process (kvmesh_kernels/interpreter.py), and torch-backend users need no Triton.
        from services.worker.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch, cpu or triton")
