"""Paged attention for the CPU: a small C kernel (kvmesh_kernels/cpu/paged_decode_attention.c) compiled
once with the system's C compiler (kvmesh_kernels/native.py) and called through ctypes.

Gathering each sequence's blocks into a dense tensor and calling SDPA costs more than the whole
MLP at decode batch sizes on a CPU; reading the paged cache in place removes that copy. Each row of
q is one query token with its own context length: decodes, and (with `seq_of_row`) the tokens of
prefill chunks, each attending causally up to its own position, all in one call.
"""

from __future__ import annotations

import ctypes

import torch

from kvmesh_kernels import native
from kvmesh_kernels.native import FAST_MATH, NativeKernelUnavailable

__all__ = ["NativeKernelUnavailable", "build", "is_available", "paged_decode_attention", "prefill_bf16_built",
           "variant", "vector_width"]

_BASE_FLAGS = ("-O3", *FAST_MATH, "-fopenmp")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NAME = "paged_decode_attention"


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.vector_width.restype, lib.vector_width.argtypes = ctypes.c_int, []
    lib.prefill_bf16_built.restype, lib.prefill_bf16_built.argtypes = ctypes.c_int, []
    fn = lib.paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_float,
                                                                ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                                                ctypes.c_int, ctypes.c_int]
    return lib


# The served build (`build(cache_dir)`) and the other instruction sets' (`variant(isa, cache_dir)`).
_KERNEL = native.Kernel(_NAME, _BASE_FLAGS, _declare)
build, variant, is_available, compile_ahead = _KERNEL.build, _KERNEL.variant, _KERNEL.available, _KERNEL.compile_ahead


def vector_width(lib: ctypes.CDLL | None = None) -> int:
    """The float lanes of the build's vector path (16: AVX-512, 8: AVX2 + FMA), 1: the scalar code."""
    return (lib or _library()).vector_width()


def prefill_bf16_built(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the build multiplies prefill tiles in bfloat16 when asked (`prefill_bf16`): AVX-512 with
    AVX512_BF16."""
    return bool((lib or _library()).prefill_bf16_built())


def _library() -> ctypes.CDLL:
    return native.library(_NAME)


def paged_decode_attention(
    out: torch.Tensor,  # [B, H, D], written
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: row b attends its request's first seq_lens[b] tokens
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    lib: ctypes.CDLL | None = None,  # a `variant`; default: the served build
    seq_of_row: torch.Tensor | None = None,  # [B] int32 row -> its request's row of block_table; None: b -> b
    prefill_bf16: bool = False,  # a prefill run's products in bfloat16, where the build has them
) -> torch.Tensor:
    num_seqs, num_heads, head_size = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if q.dtype not in _DTYPES or not (q.dtype == k_cache.dtype == v_cache.dtype == out.dtype):
        raise TypeError(f"q, caches and out must share float32, bfloat16 or float16, got {q.dtype}, {k_cache.dtype}")
    if q.device.type != "cpu":
        raise ValueError("the native decode kernel runs on the CPU")
    if q.stride(2) != 1 or q.stride(1) != head_size or out.stride(2) != 1 or out.stride(1) != head_size:
        raise ValueError("q and out must be contiguous over heads and head_size")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise TypeError("block_table and seq_lens must be int32")
    if seq_lens.shape != (num_seqs,) or not block_table.is_contiguous() or (
            seq_of_row is None and block_table.shape[0] != num_seqs):
        raise ValueError("block_table must be [B, max_blocks] contiguous (or seq_of_row given) and seq_lens [B]")
    # seq_of_row's values are not read back here (a sync per layer): the plan builds them in range.
    if seq_of_row is not None and (seq_of_row.dtype != torch.int32 or seq_of_row.shape != (num_seqs,)
                                   or not seq_of_row.is_contiguous()):
        raise ValueError("seq_of_row must be [B] int32, contiguous")
    if num_heads % num_kv_heads or num_heads // num_kv_heads > 16 or head_size > 256:
        raise ValueError(f"unsupported heads: {num_heads} query / {num_kv_heads} kv, head size {head_size}")
    rc = (lib or _library()).paged_decode_attention(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_table.data_ptr(), seq_lens.data_ptr(), None if seq_of_row is None else seq_of_row.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_size, block_size, block_table.shape[1],
        scale, sliding_window or 0, soft_cap or 0.0, _DTYPES[q.dtype], q.stride(0), out.stride(0),
        torch.get_num_threads(), int(prefill_bf16),
    )
    if rc != 0:
        raise ValueError("paged_decode_attention rejected its arguments")
    return out
