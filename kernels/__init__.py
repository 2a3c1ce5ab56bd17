"""Triton kernels (PagedAttention, KV-cache write) and their plain-torch references.

Note: `kernels` is also the import name of a Hugging Face package; transformers must keep seeing
`is_kernels_available() == False` in our environment (tests/unit/test_packaging.py).

The Triton modules are imported on first use of their names, not with the package: `@triton.jit`
fixes compiled-or-interpreted (TRITON_INTERPRET) when a kernel's module is imported
(kernels/interpreter.py), and `import kernels` must not fix it for the whole process.
"""

from __future__ import annotations

import importlib
from typing import Any

from kernels.reference import paged_attention_ref, reshape_and_cache_ref

_LAZY = {
    "AttentionParams": "kernels.paged_attention",
    "PagedBatch": "kernels.paged_attention",
    "choose_num_splits": "kernels.paged_attention",
    "paged_attention": "kernels.paged_attention",
    "reshape_and_cache": "kernels.reshape_and_cache",
}

__all__ = ["paged_attention_ref", "reshape_and_cache_ref", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
