"""Paged attention over a variable-length batch, in one launch.

The batch is the engine's flat run of tokens (services/worker/attention/metadata.py): request i
has q_len_i new tokens at query_start_loc[i]:query_start_loc[i+1] and a context of seq_lens[i]
tokens, the last q_len_i of them the new ones (already written to the cache by
`reshape_and_cache`). Its token j sits at position seq_lens[i] - q_len_i + j and attends causally to
its context through the block table; a prefill chunk and a single-token decode are the same case.

One kernel, grid (q blocks, num_kv_heads, num_splits). A program takes BLOCK_Q tokens of one
request and all GROUP = num_heads / num_kv_heads query heads of one KV head, so each K/V tile is
loaded once for the whole group (GQA). Its BLOCK_M = BLOCK_Q * GROUP (padded) rows are

    row m -> token q_block_start + m // GROUP, query head kv_head * GROUP + m % GROUP

and it walks the context in tiles of TILE_N positions, gathering each position's slot from the
block table, with an online softmax in float32:

    positions  0 ............................ context_len ........ seq_len
               |  cached context (full attention) | this step's tokens |
               tile tile tile ...                    causal inside ---->
               (a sliding window of W starts the walk at q_pos - W + 1)

The grid has an upper bound of q blocks, num_tokens // BLOCK_Q + num_reqs, so no host sync is
needed: request i owns the q blocks from query_start_loc[i] // BLOCK_Q + i on (at least
cdiv(q_len_i, BLOCK_Q) of them), a program finds its request by binary search over that sequence
and leaves if it has no tokens.

Split-KV (flash-decoding): with num_splits == 1 a program walks its whole range and writes the
output. With more, program (q block, kv head, split) walks only its split's share of the tiles and
writes that share's output (normalised by its own sum) and log-sum-exp in float32; a small
reduction kernel, grid (num_tokens, num_heads), combines the shares. `choose_num_splits` picks more
than one only for decode-only batches too small to fill the device, from host integers.

References: `kvmesh_kernels.reference.paged_attention_ref`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple
import os

import torch
import triton
import triton.language as tl

from kvmesh_kernels.interpreter import check_device, dot_in_fp32

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TILE_N = 64  # context positions per step of the walk: 4 blocks of 16, 2 of 32
MIN_BLOCK_M = 16  # tl.dot needs at least 16 rows
MAX_BLOCK_M = 64  # rows of a prefill program: 64 query rows reuse each K/V tile 64 times
SPLIT_MIN_TOKENS = 256  # the smallest share of a context one split program reads
MAX_SPLITS = 64


class PagedBatch(NamedTuple):
    """The step's batch as the kernels read it: int32 tensors on the kernels' device, plus host ints."""

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    max_query_len: int
    max_seq_len: int


class AttentionParams(NamedTuple):
    scale: float
    sliding_window: int | None = None  # attend to the last W positions, the token's own included
    logits_soft_cap: float | None = None  # scores -> cap * tanh(scores / cap)


# --- device code ---------------------------------------------------------------------------------

@triton.jit
def _tanh(x):
    # tanh from one exp, stable for any |x| (no tl.tanh in every Triton version).
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_size]; NUM_SPLITS == 1
    partial_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_PAD] float32; NUM_SPLITS > 1
    partial_lse_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32; NUM_SPLITS > 1
    q_ptr, kv_cache_ptr, query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
    scale, soft_cap, window, num_reqs, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_head, stride_bt,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Scalars and offsets in int64: no int32 overflow in the address arithmetic of a large cache
    # (and no overflow checks on every int32 operation under the interpreter).
    q_block = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)

    # This q block's request: the last i with query_start_loc[i] // BLOCK_Q + i <= q_block.
    lo = q_block * 0
    hi = lo + num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid).to(tl.int64) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    req = lo - 1
    q_start = tl.load(query_start_loc_ptr + req).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + req + 1).to(tl.int64) - q_start
    q_block_start = (q_block - (q_start // BLOCK_Q + req)) * BLOCK_Q
    if q_block_start >= q_len:
        return
    context_len = tl.load(seq_lens_ptr + req).to(tl.int64) - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_SIZE
    q_local = q_block_start + offs_m // GROUP  # [BLOCK_M] token within the request
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m // GROUP < BLOCK_Q) & (q_local < q_len)
    q_pos = context_len + q_local
    token = q_start + q_local
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, HEAD_PAD]
    if DOT_FP32:
        q = q.to(tl.float32)

    # Context positions this program reads: up to the block's last token, from its first token's
    # window start; with splits, only this split's share of those tiles.
    kv_hi = context_len + tl.minimum(q_block_start + BLOCK_Q, q_len)
    kv_lo = kv_hi * 0
    if USE_WINDOW:
        kv_lo = tl.maximum(context_len + q_block_start - window + 1, 0)
    if NUM_SPLITS > 1:
        base = (kv_lo // TILE_N) * TILE_N
        tiles_per_split = ((kv_hi - base + TILE_N - 1) // TILE_N + NUM_SPLITS - 1) // NUM_SPLITS
        kv_lo = tl.maximum(kv_lo, base + split * tiles_per_split * TILE_N)
        kv_hi = tl.minimum(kv_hi, base + (split + 1) * tiles_per_split * TILE_N)

    k_base = kv_cache_ptr + kv_head * stride_c_head
    v_base = k_base + stride_c_kv
    block_table_row = block_table_ptr + req * stride_bt
    acc = tl.full([BLOCK_M, HEAD_PAD], 0.0, dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for tile_start in range((kv_lo // TILE_N) * TILE_N, kv_hi, TILE_N):
        pos = tile_start + offs_n  # [TILE_N]
        in_kv = (pos >= kv_lo) & (pos < kv_hi)
        block = tl.load(block_table_row + pos // BLOCK_SIZE, mask=in_kv, other=0).to(tl.int64)
        slot_off = block * stride_c_block + (pos % BLOCK_SIZE) * stride_c_slot  # [TILE_N]
        k = tl.load(k_base + slot_off[None, :] + offs_d[:, None],
                    mask=in_kv[None, :] & d_mask[:, None], other=0.0)  # [HEAD_PAD, TILE_N]
        v = tl.load(v_base + slot_off[:, None] + offs_d[None, :],
                    mask=in_kv[:, None] & d_mask[None, :], other=0.0)  # [TILE_N, HEAD_PAD]
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [BLOCK_M, TILE_N] float32
        if USE_SOFT_CAP:
            s = soft_cap * _tanh(s / soft_cap)
        allowed = row_valid[:, None] & in_kv[None, :] & (pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing allowed yet keeps max -inf; subtract 0 instead so no inf - inf = NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_ref[:, None])
        alpha = tl.exp(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v.dtype)  # the value product takes the cache dtype, as the tensor cores do
        if DOT_FP32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Without splits every valid row attends at least to itself, so l_i > 0 there. A split's share
    # can be empty for a row (before its window, after its position): output 0, lse -inf.
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])
    else:
        row = (token * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(partial_out_ptr + row[:, None] * HEAD_PAD + offs_d[None, :], out, mask=row_valid[:, None])
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        tl.store(partial_lse_ptr + row, lse, mask=row_valid)


@triton.jit
def _split_kv_reduce_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr, query_start_loc_ptr,
    num_reqs, num_heads, stride_ot, stride_oh,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_reqs):
        return  # padding past the batch's last token
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    s_mask = offs_s < NUM_SPLITS
    row = (token.to(tl.int64) * num_heads + head) * NUM_SPLITS + offs_s  # [SPLITS_PAD]
    lse = tl.load(partial_lse_ptr + row, mask=s_mask, other=float("-inf"))
    # The split holding the token's own position is never empty, so the max is finite.
    weight = tl.exp(lse - tl.max(lse, 0))  # [SPLITS_PAD]
    part = tl.load(partial_out_ptr + row[:, None] * HEAD_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)  # [HEAD_PAD]
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_SIZE)


# --- launchers ------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def device_num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; CPU cores elsewhere (the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return os.cpu_count() or 1


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                      num_sms: int) -> int:
    """1 (one pass over each context) unless the batch is decode-only and its num_reqs * num_kv_heads programs
    leave most of the device idle; then enough splits, a power of two, for about two programs per
    SM, each reading at least SPLIT_MIN_TOKENS positions."""
    programs = num_reqs * num_kv_heads
    if max_query_len != 1 or programs >= num_sms or max_seq_len < 2 * SPLIT_MIN_TOKENS:
        return 1
    wanted = min(triton.cdiv(2 * num_sms, programs), max_seq_len // SPLIT_MIN_TOKENS, MAX_SPLITS)
    return 1 << (wanted.bit_length() - 1)  # round down to a power of two: few kernel variants


def check_supported(device: torch.device) -> None:
    """Raise unless these kernels can run on `device` (CUDA, or anything under the interpreter)."""
    check_device(_paged_attention_kernel, torch.empty(0, device=device))


def _check(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, batch: PagedBatch,
           params: AttentionParams) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_size], got {tuple(q.shape)}")
    num_heads, head_size = q.shape[1:]
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[4] != head_size:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, {head_size}], "
                         f"got {tuple(kv_cache.shape)}")
    if num_heads % kv_cache.shape[3]:
        raise ValueError(f"{num_heads} query heads are not a multiple of {kv_cache.shape[3]} KV heads")
    if out.shape != q.shape:
        raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    if q.dtype not in DTYPES or kv_cache.dtype != q.dtype or out.dtype != q.dtype:
        raise ValueError(f"q, kv_cache and out must share one dtype of {DTYPES}, got {q.dtype}, "
                         f"{kv_cache.dtype}, {out.dtype}")
    if q.stride(2) != 1 or out.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("q, out and kv_cache must be contiguous in head_size")
    num_reqs = batch.seq_lens.shape[0]
    for name, t, shape in (("query_start_loc", batch.query_start_loc, (num_reqs + 1,)),
                           ("seq_lens", batch.seq_lens, (num_reqs,))):
        if t.dtype != torch.int32 or tuple(t.shape) != shape or t.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous {list(shape)} int32 tensor, got {tuple(t.shape)} {t.dtype}")
    table = batch.block_table
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != num_reqs or table.stride(1) != 1:
        raise ValueError(f"block_table must be [{num_reqs}, max_blocks] int32, contiguous in blocks, got "
                         f"{tuple(table.shape)} {table.dtype}")
    if batch.max_seq_len > table.shape[1] * kv_cache.shape[2]:
        raise ValueError(f"max_seq_len {batch.max_seq_len} exceeds the block table's "
                         f"{table.shape[1]} blocks of {kv_cache.shape[2]}")
    if not params.scale > 0:
        raise ValueError(f"scale must be positive, got {params.scale}")
    if params.sliding_window is not None and params.sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {params.sliding_window}")
    if params.logits_soft_cap is not None and not params.logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be positive, got {params.logits_soft_cap}")
    check_device(_paged_attention_kernel, q, kv_cache, out, batch.query_start_loc, batch.seq_lens, table)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, batch: PagedBatch,
                    params: AttentionParams, num_splits: int | None = None) -> None:
    """Write attention of every token of `batch` into `out` ([num_tokens, num_heads, head_size]).

    q: [num_tokens, num_heads, head_size]; kv_cache: [2, num_blocks, block_size, num_kv_heads,
    head_size] already holding this step's K/V. num_splits: None lets `choose_num_splits` pick;
    1 forces the one-pass kernel, more forces the split-KV path (meant for decodes, right for any
    batch). Rows of tokens past query_start_loc[-1] are not written.
    """
    _check(q, kv_cache, out, batch, params)
    num_tokens, num_heads = q.shape[:2]
    num_kv_heads = kv_cache.shape[3]
    num_reqs = batch.seq_lens.shape[0]
    if num_splits is None:
        num_splits = choose_num_splits(num_reqs, num_kv_heads, batch.max_query_len, batch.max_seq_len,
                                       device_num_sms(q.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    if num_tokens == 0 or num_reqs == 0:
        return
    group = num_heads // num_kv_heads
    # Decode-only batches need GROUP rows per request; prefill chunks as many rows as fit.
    block_m = min(max(MIN_BLOCK_M, triton.next_power_of_2(batch.max_query_len * group)),
                  max(MAX_BLOCK_M, triton.next_power_of_2(group)))
    block_q = block_m // group
    head_size = q.shape[2]
    head_pad = triton.next_power_of_2(head_size)
    if num_splits == 1:
        partial_out = partial_lse = out  # not read: the kernel writes `out` itself
    else:
        partial_out = torch.empty((num_tokens, num_heads, num_splits, head_pad), dtype=torch.float32,
                                  device=q.device)
        partial_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
    grid = (num_tokens // block_q + num_reqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        out, partial_out, partial_lse, q, kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
        params.scale, params.logits_soft_cap or 0.0, params.sliding_window or 0, num_reqs, num_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), batch.block_table.stride(0),
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        BLOCK_SIZE=kv_cache.shape[2], TILE_N=TILE_N, NUM_SPLITS=num_splits,
        USE_WINDOW=params.sliding_window is not None, USE_SOFT_CAP=params.logits_soft_cap is not None,
        DOT_FP32=dot_in_fp32(_paged_attention_kernel, q.dtype),
        # float32 stays float32 (no TF32 rounding): a float32 model asked for float32 attention.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    if num_splits > 1:
        _split_kv_reduce_kernel[(num_tokens, num_heads)](
            out, partial_out, partial_lse, batch.query_start_loc, num_reqs, num_heads, out.stride(0), out.stride(1),
            HEAD_SIZE=head_size, HEAD_PAD=head_pad, NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
