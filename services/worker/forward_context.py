"""The forward context: the one global of the worker, holding what attention layers need for one
model forward (metadata, the backend's per-step plan, the KV caches, the LoRA segments). Entered with a context
manager that refuses nesting."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from services.worker.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: AttentionMetadata
    plan: Any  # the backend's per-step plan, built once and shared by all layers
    kv_caches: list[torch.Tensor]
    backend: Any  # AttentionBackend
    # LoRA: the step's request segments and their adapters' slots (services/worker/lora/manager.py
    # LoRAMapping); None when no request of the step runs with an adapter.
    lora: Any = None


class _Holder:
    current: ForwardContext | None = None


_holder = _Holder()


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[None]:
    if _holder.current is not None:
        raise RuntimeError("forward contexts do not nest")
    _holder.current = context
    try:
        yield
    finally:
        _holder.current = None


def get_forward_context() -> ForwardContext:
    if _holder.current is None:
        raise RuntimeError("attention called outside set_forward_context()")
    return _holder.current
