"""Choosing an attention backend: `auto` is Triton on CUDA; on the CPU it is `cpu` (the torch
backend's plan with the native paged attention kernel: every token of a step, decodes and prefill
chunks, in one call) when a C compiler can build that kernel, else `torch`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from kvmesh_kernels import cpu_fused_ops, cpu_paged_attention
from services.common.config import default_cache_dir
from services.worker.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def plan(self, meta: AttentionMetadata) -> Any: ...

    def forward(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, plan: Any) -> torch.Tensor: ...


from services.worker.attention.torch_backend import TorchAttentionBackend


def get_attention_backend(name: str, device: torch.device, cache_dir: Path | None = None) -> AttentionBackend:
    """`cache_dir` (default: `default_cache_dir()`) keeps the native CPU kernel's build."""
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
        return TorchAttentionBackend(native_decode=True)
    if name == "triton":
        # Imported here, not at the top: importing the kernels fixes Triton's compiled-or-interpreted
        # choice for the process (kvmesh_kernels/interpreter.py), and torch-backend users need no Triton.
        from services.worker.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch, cpu or triton")
