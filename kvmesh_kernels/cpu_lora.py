"""Batched LoRA on the CPU (kvmesh_kernels/cpu/lora.c): `lora_shrink` and `lora_expand` over a flat batch
of segments, each segment one adapter slot, in one native call each instead of a torch matmul per
segment. Their arguments are checked by `kvmesh_kernels.lora`, the public entry; these launchers only
turn tensors into pointers, strides and element counts.

The worker builds the library once at start-up (`available(cache_dir)`); `usable(x)` says whether a
tensor can take this path (built, a CPU tensor of a supported dtype).
"""

from __future__ import annotations

import ctypes

import torch

from kvmesh_kernels import native
from kvmesh_kernels.native import FAST_MATH

_BASE_FLAGS = ("-O3", *FAST_MATH, "-fopenmp")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_NAME = "lora"


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    segmented = [_P, _I64, _P, _I64, _P, _I64, _I64, _I64, _P, _P, _I64, _I64, _I64, _I64, _INT, _INT, _INT]
    for name in ("lora_shrink", "lora_expand", "lora_expand_t"):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = _INT, segmented
    lib.lora_isa.restype, lib.lora_isa.argtypes = _INT, []
    return lib


# The served build (`build(cache_dir)`) and the other instruction sets' (`variant(isa, cache_dir)`).
_KERNEL = native.Kernel(_NAME, _BASE_FLAGS, _declare)
build, variant, available, compile_ahead = _KERNEL.build, _KERNEL.variant, _KERNEL.available, _KERNEL.compile_ahead


def supported(dtype: torch.dtype, weight_dtype: torch.dtype) -> bool:
    """Whether the kernels take activations of `dtype` with weights of `weight_dtype`: both float32, both
    bfloat16, or bfloat16 weights under float32 activations."""
    return dtype in DTYPES and (weight_dtype == dtype or (dtype, weight_dtype) == (torch.float32, torch.bfloat16))


def usable(x: torch.Tensor) -> bool:
    """Whether the native kernels can take `x`: a CPU tensor of a supported dtype, and the library built."""
    return x.device.type == "cpu" and x.dtype in DTYPES and native.is_built(_NAME)


def isa(lib: ctypes.CDLL | None = None) -> int:
    """The vector bits of a build's code path: 512, 256 or 0 (portable C)."""
    return (lib or native.library(_NAME)).lora_isa()


def lora_shrink(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, seg_indptr: torch.Tensor,
                seg_slots: torch.Tensor, lib: ctypes.CDLL | None = None) -> bool:
    """y[rows of segment i] = x[rows] @ a_stack[seg_slots[i]].T, zeros where the slot is -1. y: [T, R]
    float32; x: [T, K]; a_stack: [S, R, K] of x's dtype (or bfloat16 under float32 x: `supported`); each
    with unit stride in its last dim; seg_indptr and seg_slots contiguous int32. False, with y untouched,
    when the segments are not rows 0..T in order or a slot is out of range."""
    num_rows, k = x.shape
    num_slots, rank = a_stack.shape[:2]
    return (lib or native.library(_NAME)).lora_shrink(
        y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), a_stack.data_ptr(), a_stack.stride(0),
        a_stack.stride(1), num_slots, seg_indptr.data_ptr(), seg_slots.data_ptr(), seg_slots.shape[0], num_rows,
        rank, k, DTYPES[x.dtype], DTYPES[a_stack.dtype], torch.get_num_threads()) == 0


def lora_expand(out: torch.Tensor, y: torch.Tensor, b_stack: torch.Tensor, seg_indptr: torch.Tensor,
                seg_slots: torch.Tensor, lib: ctypes.CDLL | None = None) -> bool:
    """out[rows of segment i] += y[rows] @ b_stack[seg_slots[i]].T where the slot is >= 0, rounded once.
    out: [T, n] (a column slice of a wider tensor is fine); y: [T, R] float32; out and y with unit stride
    in their last dim; b_stack: [S, n, R] of out's dtype (or as `supported`), with unit stride in its last
    dim or, stored transposed (`transposed`), in its middle one. False, out untouched, as `lora_shrink`."""
    num_rows, n = out.shape
    num_slots, _, rank = b_stack.shape
    library = lib or native.library(_NAME)
    # The transposed layout's kernel reads B's rows of n in place; the other reduces along R.
    fn, ld_b = (library.lora_expand_t, b_stack.stride(2)) if transposed(b_stack) else (library.lora_expand,
                                                                                          b_stack.stride(1))
    return fn(out.data_ptr(), out.stride(0), y.data_ptr(), y.stride(0), b_stack.data_ptr(), b_stack.stride(0), ld_b,
              num_slots, seg_indptr.data_ptr(), seg_slots.data_ptr(), seg_slots.shape[0], num_rows, n, rank,
              DTYPES[out.dtype], DTYPES[b_stack.dtype], torch.get_num_threads()) == 0


def transposed(b_stack: torch.Tensor) -> bool:
    """Whether a [S, n, R] stack is stored as R rows of n per slot (unit stride along n), the layout the
    CPU's expand reads fastest."""
    return b_stack.stride(1) == 1 and b_stack.shape[2] > 1 and b_stack.stride(2) >= b_stack.shape[1]
