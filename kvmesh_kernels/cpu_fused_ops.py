"""Fused CPU ops for the model's per-layer glue (kvmesh_kernels/cpu/fused_ops.c), each one call instead of
several torch ops, at the same rounding as the torch code they replace:

  kv_write          the step's K and V rows into their paged-cache slots (two index_copy_)
  rope_inplace      neox RoPE on q and k together, in the qkv projection's output (chunk, 4 mul,
                    sub, add, cat per tensor)
  rms_norm          bfloat16 or float16 RMSNorm (to float, rms_norm, back, weight mul), and the
                    float32 one (torch's F.rms_norm: ~7 us a call at one token, 61 calls a step
                    for the default model; this one ~2 us and never a parallel region below 64 tokens)
  add_rms_norm      the decoder layer's residual add and the next RMSNorm in one pass
  silu_and_mul      the MLP's SiLU(gate) * up in float32 (its exp a polynomial, ~1 ulp from torch's)
  gelu_tanh_and_mul Gemma's GELU(gate, tanh approximation) * up in float32, through the same exp

At a decode batch of 128 on the 2-core test machine they take a third to a fifth of the time of
the torch ops they replace, mostly dispatch, temporaries and dtype copies of small tensors.
The activations alone gain little over torch's (bound by their exp and division); they are here so
that the whole decoder can run as one native call (kvmesh_kernels/cpu_decoder.py) with the same rounding as
the layers' modules, which call them too.
The worker builds them once at start-up (`available(cache_dir)`); callers check `usable(x)`: built,
and a CPU tensor of a supported dtype. The torch code stays the path everywhere else (CUDA, no
compiler, not built).
"""

from __future__ import annotations

import ctypes

import torch

from kvmesh_kernels import native
from kvmesh_kernels.native import FAST_MATH

_BASE_FLAGS = ("-O3", *FAST_MATH, "-ffp-contract=off", "-fopenmp")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_NAME = "fused_ops"


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    signatures = {
        "kv_write": [_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64],
        "rope_inplace": [_P, _I64, _P, _I64, _I64, _INT, _INT, _INT, _INT],
        "rms_norm": [_P, _P, _P, _I64, _INT, _F, _INT, _INT],
        "add_rms_norm": [_P, _P, _P, _P, _P, _I64, _INT, _F, _INT, _INT],
        "silu_and_mul": [_P, _P, _I64, _I64, _INT],
        "gelu_tanh_and_mul": [_P, _P, _I64, _I64, _INT],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, argtypes
    return lib


# The served build (`build(cache_dir)`) and the other instruction sets' (`variant(isa, cache_dir)`).
_KERNEL = native.Kernel(_NAME, _BASE_FLAGS, _declare)
build, variant, available, compile_ahead = _KERNEL.build, _KERNEL.variant, _KERNEL.available, _KERNEL.compile_ahead


def _library() -> ctypes.CDLL:
    return native.library(_NAME)


def usable(x: torch.Tensor) -> bool:
    """Whether the fused ops can take `x`: a CPU tensor of a supported dtype, and the ops built."""
    return x.device.type == "cpu" and x.dtype in _DTYPES and native.is_built(_NAME)


def kv_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, lib: ctypes.CDLL | None = None) -> None:
    """k_cache, v_cache: [num_blocks, block_size, Hkv, D] contiguous; k, v: [n, Hkv, D] with each
    row contiguous; slot_mapping: [n] int64, -1 = padding (skipped)."""
    n, num_kv_heads, head_size = k.shape
    row = num_kv_heads * head_size
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.dtype != k.dtype:
        raise ValueError("kv_write needs contiguous caches of k's dtype")
    if k.stride(1) != head_size or k.stride(2) != 1 or v.stride(1) != head_size or v.stride(2) != 1:
        raise ValueError("kv_write needs each token's K and V row contiguous")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (n,) or not slot_mapping.is_contiguous():
        raise ValueError(f"slot_mapping must be [{n}] int64, contiguous")
    size = k.element_size()
    (lib or _library()).kv_write(k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(),
                                 slot_mapping.data_ptr(), n, row * size, k.stride(0) * size, v.stride(0) * size)


def rope_inplace(x: torch.Tensor, cos_sin: torch.Tensor, num_heads: int, head_size: int,
                 lib: ctypes.CDLL | None = None) -> None:
    """x: [n, >= num_heads * head_size] rows (the first num_heads heads are rotated, in place);
    cos_sin: [n, head_size] = cos | sin, x's dtype."""
    n = x.shape[0]
    if x.stride(-1) != 1 or cos_sin.stride(-1) != 1 or cos_sin.dtype != x.dtype or cos_sin.shape != (n, head_size):
        raise ValueError("rope_inplace needs unit-stride rows and a [n, head_size] cos|sin of x's dtype")
    (lib or _library()).rope_inplace(x.data_ptr(), x.stride(0), cos_sin.data_ptr(), cos_sin.stride(0), n,
                                     num_heads, head_size, _DTYPES[x.dtype], torch.get_num_threads())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x: [n, hidden] float32, bfloat16 or float16, contiguous -> a new [n, hidden] tensor."""
    _check_norm(x, weight)
    out = torch.empty_like(x)
    (lib or _library()).rms_norm(out.data_ptr(), x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps,
                                 _DTYPES[x.dtype], torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) as new tensors; x, residual: [n, hidden] contiguous."""
    _check_norm(x, weight)
    if residual.dtype != x.dtype or residual.shape != x.shape or not residual.is_contiguous():
        raise ValueError("add_rms_norm needs a contiguous residual of x's shape and dtype")
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    (lib or _library()).add_rms_norm(out.data_ptr(), residual_out.data_ptr(), x.data_ptr(), residual.data_ptr(),
                                     weight.data_ptr(), x.shape[0], x.shape[1], eps, _DTYPES[x.dtype],
                                     torch.get_num_threads())
    return out, residual_out


def _check_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype != weight.dtype or not x.is_contiguous() or not weight.is_contiguous() or x.dim() != 2:
        raise ValueError("the native RMSNorm needs a contiguous [n, hidden] input and a weight of one dtype")


def silu_and_mul(x: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x: [n, 2 * inter] float32 (gate | up), contiguous -> a new [n, inter]: silu(gate) * up."""
    return _gated(x, "silu_and_mul", lib)


def gelu_tanh_and_mul(x: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x: [n, 2 * inter] float32 (gate | up), contiguous -> a new [n, inter]: gelu_tanh(gate) * up."""
    return _gated(x, "gelu_tanh_and_mul", lib)


def _gated(x: torch.Tensor, name: str, lib: ctypes.CDLL | None) -> torch.Tensor:
    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or x.shape[1] % 2:
        raise ValueError(f"{name} needs a contiguous [n, 2 * inter] float32 input")
    inter = x.shape[1] // 2
    out = torch.empty(x.shape[0], inter, dtype=torch.float32)
    getattr(lib or _library(), name)(out.data_ptr(), x.data_ptr(), x.shape[0], inter, torch.get_num_threads())
    return out
