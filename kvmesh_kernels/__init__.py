"""Triton kernels (PagedAttention, KV-cache write) and their plain-torch references.

Named `kvmesh_kernels`, not `kernels`: that is the import name of a Hugging Face package that
transformers requires and imports (tests/unit/test_packaging.py).

The Triton modules are imported on first use of their names, not with the package: `@triton.jit`
fixes compiled-or-interpreted (TRITON_INTERPRET) when a kernel's module is imported
(kvmesh_kernels/interpreter.py), and `import kvmesh_kernels` must not fix it for the whole process.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvmesh_kernels.reference import paged_attention_ref, reshape_and_cache_ref

_LAZY = {
    "AttentionParams": "kvmesh_kernels.paged_attention",
    "PagedBatch": "kvmesh_kernels.paged_attention",
    "choose_num_splits": "kvmesh_kernels.paged_attention",
    "paged_attention": "kvmesh_kernels.paged_attention",
    "reshape_and_cache": "kvmesh_kernels.reshape_and_cache",
}

__all__ = ["paged_attention_ref", "reshape_and_cache_ref", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
