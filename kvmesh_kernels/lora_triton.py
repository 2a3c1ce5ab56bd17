"""Batched LoRA in Triton: punica's SGMV shrink and expand over the engine's flat batch, one launch each.

The batch is requests back to back; request i is segment i, rows seg_indptr[i]:seg_indptr[i+1], all
of one adapter slot seg_slots[i] (-1: the base model, no LoRA):

    shrink  y[rows, :R]                    = x[rows] @ a_stack[slot].T    a_stack: [S, R, in]
    expand  out[rows, off:off + n]        += y[rows] @ b_stack[slot].T    b_stack: [S, n, R]

Grid (row blocks, output tiles). A program takes BLOCK_M rows of one segment and BLOCK_N outputs
(ranks for shrink, columns for expand) and walks the reduction in BLOCK_K steps with tl.dot. As in
paged attention, the row blocks need no host sync: segment i owns the programs from
seg_indptr[i] // BLOCK_M + i on (at least cdiv(len_i, BLOCK_M) of them), so T // BLOCK_M + N
programs cover every segment; a program finds its segment by binary search and leaves when it has
no rows or its slot is -1. Shrink's output starts as zeros, so slot -1 rows stay zeros.

Row and slot masks keep every load in bounds whatever the index tensors hold (the host checks them
only where they live on the CPU, to avoid a device sync). References: `kvmesh_kernels.reference`
`lora_shrink_ref` and `lora_expand_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmesh_kernels.interpreter import check_device, dot_in_fp32, is_interpreted

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_BLOCK = 16  # tl.dot needs at least 16 along each dimension
MAX_BLOCK_M = 64  # rows of a program in a batch of long segments (prefill)
BLOCK_N_EXPAND = 64  # output columns of an expand program
MAX_BLOCK_K = 128  # reduction step


@triton.jit
def _segment_rows(seg_indptr_ptr, num_segs, num_rows, BLOCK_M: tl.constexpr):
    """This program's segment and its rows [row_start, row_end), clamped to the batch."""
    block = tl.program_id(0).to(tl.int64)
    # The last segment i with seg_indptr[i] // BLOCK_M + i <= block.
    lo = block * 0
    hi = lo + num_segs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(seg_indptr_ptr + mid).to(tl.int64) // BLOCK_M + mid <= block:
            lo = mid + 1
        else:
            hi = mid
    seg = tl.maximum(lo - 1, 0)
    seg_start = tl.load(seg_indptr_ptr + seg).to(tl.int64)
    seg_end = tl.minimum(tl.load(seg_indptr_ptr + seg + 1).to(tl.int64), num_rows)
    row_start = tl.maximum(seg_start + (block - (seg_start // BLOCK_M + seg)) * BLOCK_M, 0)
    return seg, row_start, seg_end


@triton.jit
def _lora_shrink_kernel(
    y_ptr,  # [num_rows, rank] float32, zeros on entry
    x_ptr, a_ptr, seg_indptr_ptr, seg_slots_ptr,
    num_segs, num_rows, num_slots, rank, k_dim,
    stride_yt, stride_xt, stride_as, stride_ar,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seg, row_start, row_end = _segment_rows(seg_indptr_ptr, num_segs, num_rows, BLOCK_M)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    if row_start >= row_end or slot < 0 or slot >= num_slots:
        return
    rows = row_start + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_mask = rows < row_end
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] ranks
    n_mask = offs_n < rank
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + slot * stride_as + offs_n[None, :] * stride_ar
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < k_dim
        x = tl.load(x_ptr + rows[:, None] * stride_xt + k[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        a = tl.load(a_base + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if DOT_FP32:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc += tl.dot(x, a, input_precision=DOT_PRECISION)
    tl.store(y_ptr + rows[:, None] * stride_yt + offs_n[None, :], acc, mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _lora_expand_kernel(
    out_ptr,  # [num_rows, >= n] at its column offset; += the LoRA delta, rounded once
    y_ptr, b_ptr, seg_indptr_ptr, seg_slots_ptr,
    num_segs, num_rows, num_slots, n, rank,
    stride_ot, stride_yt, stride_bs, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    seg, row_start, row_end = _segment_rows(seg_indptr_ptr, num_segs, num_rows, BLOCK_M)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    if row_start >= row_end or slot < 0 or slot >= num_slots:
        return
    rows = row_start + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_mask = rows < row_end
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns
    n_mask = offs_n < n
    offs_k = tl.arange(0, BLOCK_K)
    b_base = b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, rank, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < rank
        # y stays float32 (the shrink's sums) and B is widened to it: the ranks are few, so the
        # products cost little next to the base layer's, and y is rounded to TF32 at most, not to B's dtype.
        y = tl.load(y_ptr + rows[:, None] * stride_yt + k[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        b = tl.load(b_base + k[:, None], mask=k_mask[:, None] & n_mask[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(y, b, input_precision=DOT_PRECISION)
    out_ptrs = out_ptr + rows[:, None] * stride_ot + offs_n[None, :]
    mask = row_mask[:, None] & n_mask[None, :]
    total = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + acc
    if ROUND_BF16:
        # The interpreter truncates float32 to bfloat16; round to nearest even as the GPU does.
        bits = total.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        tl.store(out_ptrs, (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)


def _block_m(num_rows: int, num_segs: int) -> int:
    """Rows of a program: 16 for decodes (one row a segment), up to MAX_BLOCK_M for long segments."""
    mean = num_rows // max(num_segs, 1)
    return min(max(MIN_BLOCK, triton.next_power_of_2(max(mean, 1))), MAX_BLOCK_M)


def _block(size: int, cap: int) -> int:
    return min(max(MIN_BLOCK, triton.next_power_of_2(size)), cap)


def lora_shrink(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, seg_indptr: torch.Tensor,
                seg_slots: torch.Tensor) -> None:
    """y ([T, R] float32, zeros) gets x[rows] @ a_stack[slot].T for each segment of a slot >= 0.
    Shapes, dtypes and devices are checked by `kvmesh_kernels.lora`."""
    check_device(_lora_shrink_kernel, y, x, a_stack, seg_indptr, seg_slots)
    num_rows, k_dim = x.shape
    num_segs = seg_slots.shape[0]
    rank = a_stack.shape[1]
    if num_rows == 0 or num_segs == 0:
        return
    block_m, block_n = _block_m(num_rows, num_segs), _block(rank, 64)
    grid = (num_rows // block_m + num_segs, triton.cdiv(rank, block_n))
    _lora_shrink_kernel[grid](
        y, x, a_stack, seg_indptr, seg_slots, num_segs, num_rows, a_stack.shape[0], rank, k_dim,
        y.stride(0), x.stride(0), a_stack.stride(0), a_stack.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_block(k_dim, MAX_BLOCK_K),
        DOT_FP32=dot_in_fp32(_lora_shrink_kernel, x.dtype),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )


def lora_expand(out: torch.Tensor, y: torch.Tensor, b_stack: torch.Tensor, seg_indptr: torch.Tensor,
                seg_slots: torch.Tensor) -> None:
    """out ([T, n], a column slice of a wider tensor is fine) += y[rows] @ b_stack[slot].T for each segment
    of a slot >= 0. Shapes, dtypes and devices are checked by `kvmesh_kernels.lora`."""
    check_device(_lora_expand_kernel, out, y, b_stack, seg_indptr, seg_slots)
    num_rows, n = out.shape
    num_segs = seg_slots.shape[0]
    rank = b_stack.shape[2]
    if num_rows == 0 or num_segs == 0:
        return
    block_m = _block_m(num_rows, num_segs)
    grid = (num_rows // block_m + num_segs, triton.cdiv(n, BLOCK_N_EXPAND))
    _lora_expand_kernel[grid](
        out, y, b_stack, seg_indptr, seg_slots, num_segs, num_rows, b_stack.shape[0], n, rank,
        out.stride(0), y.stride(0), b_stack.stride(0), b_stack.stride(1),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N_EXPAND, BLOCK_K=_block(rank, 64),
        # IEEE float32 whatever out's dtype: y holds the shrink's float32 sums, which TF32 would round
        # to 10 bits (an error of ~1e-3 on a GPU); the reduction is only the rank deep, so it costs little.
        DOT_PRECISION="ieee",
        ROUND_BF16=is_interpreted(_lora_expand_kernel) and out.dtype == torch.bfloat16,
    )
