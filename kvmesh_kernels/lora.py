"""Batched LoRA (punica / S-LoRA "SGMV") over the worker's flat batch: the two products of every adapted
linear layer, for all requests and adapters of a step in one call each.

Request i is segment i, rows seg_indptr[i]:seg_indptr[i+1] of the batch, served by adapter slot
seg_slots[i] (-1: the base model). A layer's adapters live in fixed slots, zero-padded to the max rank
R, with the scaling folded into B:

    a_stack [S, R, in]     y = lora_shrink(x, a_stack, ...)          y[rows] = x[rows] @ A[slot].T
    b_stack [S, n, R]      lora_expand_(out, y, b_stack, ..., off)   out[rows, off:off + n] += y[rows] @ B[slot].T

b_stack may be stored transposed (R rows of n per slot, a `transpose(1, 2)` view): the CPU's layout,
which its expand reads in place; the Triton kernels take the row-major one.

y is float32 (the sums are never rounded between the two products); out keeps its dtype and is
rounded once. A merged layer (qkv, gate_up) may shrink once over its slices' A stacks concatenated
along R and expand each slice from its columns of y (a strided view is fine) at its own offset.

Backends: "native" (kvmesh_kernels/cpu_lora.py: CPU tensors, float32 or bfloat16), "triton"
(kvmesh_kernels/lora_triton.py: CUDA, or the CPU under TRITON_INTERPRET), "torch" (the per-segment
references). "auto" takes Triton on CUDA, the native kernels on the CPU where the worker built them
(`cpu_lora.build(cache_dir)`), else the reference.

Arguments are checked here and a bad one raises ValueError naming it. The segments' values are
checked too wherever they live on the CPU (in the native call itself, at no extra pass): the kernels
read rows and slots through them. On CUDA that check would cost a device sync, so there the Triton
kernels mask every row and slot instead, and never read out of bounds.
"""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType
from typing import NoReturn

import torch

from kvmesh_kernels import cpu_lora
from kvmesh_kernels.reference import lora_expand_ref, lora_shrink_ref

BACKENDS = ("auto", "native", "triton", "torch")
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@cache
def _triton() -> ModuleType:
    # Imported on first use: `@triton.jit` fixes compiled-or-interpreted when its module is imported
    # (kvmesh_kernels/interpreter.py), and importing this module must not fix it for the process.
    return importlib.import_module("kvmesh_kernels.lora_triton")


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, seg_indptr: torch.Tensor, seg_slots: torch.Tensor,
                *, backend: str = "auto") -> torch.Tensor:
    """x: [T, in]; a_stack: [S, R, in] of x's dtype; seg_indptr: [N + 1] int32 from 0 to T; seg_slots: [N]
    int32 in -1..S-1. Returns y: [T, R] float32, x[rows] @ a_stack[slot].T per segment, zeros for slot -1."""
    _check_matrix("x", x)
    if a_stack.dim() != 3 or a_stack.shape[2] != x.shape[1]:
        raise ValueError(f"a_stack must be [num_slots, rank, {x.shape[1]}] for x of {tuple(x.shape)}, "
                         f"got {tuple(a_stack.shape)}")
    if a_stack.dtype not in (x.dtype, torch.bfloat16) or a_stack.stride(2) != 1:
        raise ValueError(f"a_stack must be of x's dtype {x.dtype} (or bfloat16) with unit stride in its last dim, "
                         f"got "
                         f"{a_stack.dtype} strides {a_stack.stride()}")
    if a_stack.device != x.device:
        raise ValueError(f"a_stack is on {a_stack.device} and x on {x.device}")
    _check_segments(seg_indptr, seg_slots, x)
    chosen = _choose(backend, x)
    _check_dtype(chosen, x.dtype, "x", a_stack.dtype)
    num_rows, rank = x.shape[0], a_stack.shape[1]
    if chosen == "native":
        y = torch.empty(num_rows, rank, dtype=torch.float32)
        if not cpu_lora.lora_shrink(y, x, a_stack, seg_indptr, seg_slots):
            _refuse_segments(seg_indptr, seg_slots, num_rows, a_stack.shape[0])
        return y
    if chosen == "triton":
        if x.device.type == "cpu":
            _check_segment_values(seg_indptr, seg_slots, num_rows, a_stack.shape[0])
        y = torch.zeros(num_rows, rank, dtype=torch.float32, device=x.device)
        _triton().lora_shrink(y, x, a_stack, seg_indptr, seg_slots)
        return y
    _check_segment_values(seg_indptr, seg_slots, num_rows, a_stack.shape[0])
    return lora_shrink_ref(x, a_stack, seg_indptr, seg_slots)


def lora_expand_(out: torch.Tensor, y: torch.Tensor, b_stack: torch.Tensor, seg_indptr: torch.Tensor,
                 seg_slots: torch.Tensor, out_offset: int, *, backend: str = "auto") -> None:
    """In place: out[rows, out_offset:out_offset + n] += y[rows] @ b_stack[slot].T for each segment of a
    slot >= 0, summed in float32 and rounded once to out's dtype. out: [T, out_total]; y: [T, R] float32
    or out's dtype (a column slice of a merged shrink's y is fine); b_stack: [S, n, R] of out's dtype."""
    _check_matrix("out", out)
    _check_matrix("y", y)
    if b_stack.dim() != 3 or b_stack.shape[2] != y.shape[1]:
        raise ValueError(f"b_stack must be [num_slots, n, {y.shape[1]}] for y of {tuple(y.shape)}, "
                         f"got {tuple(b_stack.shape)}")
    if y.shape[0] != out.shape[0]:
        raise ValueError(f"y has {y.shape[0]} rows and out {out.shape[0]}: one row per token in both")
    n = b_stack.shape[1]
    if not 0 <= out_offset <= out.shape[1] - n:
        raise ValueError(f"out_offset {out_offset} + n {n} must fit in out's {out.shape[1]} columns")
    if b_stack.dtype not in (out.dtype, torch.bfloat16) or not (b_stack.stride(2) == 1
                                                                  or cpu_lora.transposed(b_stack)):
        raise ValueError(f"b_stack must be of out's dtype {out.dtype} (or bfloat16) with unit stride in its last "
                         f"dim (or, stored transposed, in its middle one), got "
                         f"{b_stack.dtype} strides {b_stack.stride()}")
    if y.dtype not in (torch.float32, out.dtype):
        raise ValueError(f"y must be float32 or out's dtype {out.dtype}, got {y.dtype}")
    _check_segments(seg_indptr, seg_slots, out)
    for name, t in (("y", y), ("b_stack", b_stack)):
        if t.device != out.device:
            raise ValueError(f"{name} is on {t.device} and out on {out.device}")
    chosen = _choose(backend, out)
    _check_dtype(chosen, out.dtype, "out", b_stack.dtype)
    cols = out[:, out_offset:out_offset + n]
    if chosen == "native":
        if not cpu_lora.lora_expand(cols, y.float(), b_stack, seg_indptr, seg_slots):
            _refuse_segments(seg_indptr, seg_slots, out.shape[0], b_stack.shape[0])
    elif chosen == "triton":
        if b_stack.stride(2) != 1:
            raise ValueError("the Triton LoRA kernels take b_stack with unit stride in its last dim")
        if out.device.type == "cpu":
            _check_segment_values(seg_indptr, seg_slots, out.shape[0], b_stack.shape[0])
        _triton().lora_expand(cols, y, b_stack, seg_indptr, seg_slots)
    else:
        _check_segment_values(seg_indptr, seg_slots, out.shape[0], b_stack.shape[0])
        lora_expand_ref(out, y, b_stack, seg_indptr, seg_slots, out_offset)


def _choose(backend: str, x: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        if x.device.type == "cuda":
            return "triton"
        return "native" if cpu_lora.usable(x) else "torch"
    if backend == "native" and x.device.type != "cpu":
        raise ValueError(f"the native LoRA kernels take CPU tensors, got {x.device}")
    return backend


def _check_dtype(backend: str, dtype: torch.dtype, name: str, weight_dtype: torch.dtype) -> None:
    """The activations' dtype for `backend`, and the weights': of the same dtype, or (the native kernels,
    the reference) bfloat16 weights under float32 activations."""
    allowed = {"native": tuple(cpu_lora.DTYPES), "triton": _TRITON_DTYPES}.get(backend)
    if allowed is not None and dtype not in allowed:
        raise ValueError(f"{name} must be one of {allowed} for the {backend} LoRA kernels, got {dtype}")
    if weight_dtype != dtype and (backend == "triton" or not cpu_lora.supported(dtype, weight_dtype)):
        raise ValueError(f"the {backend} LoRA kernels take {name} of {dtype} with weights of the same dtype, "
                         f"got {weight_dtype}")


def _check_matrix(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be [num_tokens, columns] with unit stride in columns, got "
                         f"{tuple(t.shape)} strides {t.stride()}")


def _check_segments(seg_indptr: torch.Tensor, seg_slots: torch.Tensor, x: torch.Tensor) -> None:
    """The segment tensors' shapes, dtypes and device (not their values)."""
    if seg_slots.dim() != 1 or seg_slots.dtype != torch.int32 or not seg_slots.is_contiguous():
        raise ValueError(f"seg_slots must be a contiguous [num_segments] int32 tensor, got "
                         f"{tuple(seg_slots.shape)} {seg_slots.dtype}")
    num_segs = seg_slots.shape[0]
    if seg_indptr.shape != (num_segs + 1,) or seg_indptr.dtype != torch.int32 or not seg_indptr.is_contiguous():
        raise ValueError(f"seg_indptr must be a contiguous [{num_segs + 1}] int32 tensor for {num_segs} segments, "
                         f"got {tuple(seg_indptr.shape)} {seg_indptr.dtype}")
    if seg_indptr.device != x.device or seg_slots.device != x.device:
        raise ValueError(f"seg_indptr and seg_slots must be on {x.device} with the rows, got "
                         f"{seg_indptr.device} and {seg_slots.device}")


def _check_segment_values(seg_indptr: torch.Tensor, seg_slots: torch.Tensor, num_rows: int,
                          num_slots: int) -> None:
    """The segments cover rows 0..num_rows in order and each slot is -1 or a slot of the stack (reads the
    tensors: a device sync on CUDA)."""
    bounds = seg_indptr.tolist()
    if bounds[0] != 0 or bounds[-1] != num_rows:
        raise ValueError(f"seg_indptr must run from 0 to the {num_rows} rows, got {bounds[0]}..{bounds[-1]}")
    steps = [end - start for start, end in zip(bounds, bounds[1:])]
    if steps and min(steps) < 0:
        i = steps.index(min(steps))
        raise ValueError(f"seg_indptr must not decrease, got {bounds[i]} then {bounds[i + 1]} at segment {i}")
    slots = seg_slots.tolist()
    bad = [slot for slot in slots if not -1 <= slot < num_slots]
    if bad:
        raise ValueError(f"seg_slots must be -1 or below the {num_slots} slots, got {bad[0]}")


def _refuse_segments(seg_indptr: torch.Tensor, seg_slots: torch.Tensor, num_rows: int, num_slots: int) -> NoReturn:
    """Raise for the segments the native kernels refused, saying why."""
    _check_segment_values(seg_indptr, seg_slots, num_rows, num_slots)
    raise ValueError(f"seg_indptr or seg_slots out of range for {num_rows} rows and {num_slots} slots")
