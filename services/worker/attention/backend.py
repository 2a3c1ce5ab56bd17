"""Choosing an attention backend: `auto` is Triton on CUDA and torch elsewhere."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from services.worker.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def plan(self, meta: AttentionMetadata) -> Any: ...

    def forward(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, plan: Any) -> torch.Tensor: ...


from services.worker.attention.torch_backend import TorchAttentionBackend


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        # Imported here, not at the top: importing the kernels fixes Triton's compiled-or-interpreted
        # choice for the process (kernels/interpreter.py), and torch-backend users need no Triton.
        from services.worker.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch or triton")
