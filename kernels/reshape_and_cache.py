"""KV-cache write: the step's new K and V rows go into their paged-cache slots.

    key, value:   [num_tokens, num_kv_heads, head_size]
    slot_mapping: [num_tokens]  slot = block_id * block_size + offset; -1 = padding, skipped
    kv_cache:     [2, num_blocks, block_size, num_kv_heads, head_size]  (services/worker/kv_cache.py)

One program per token copies all of its heads; the reference is
`kernels.reference.reshape_and_cache_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.interpreter import check_device

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    kv_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c_kv,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_SIZE)[None, :]
    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst = (kv_cache_ptr + (slot // BLOCK_SIZE) * stride_c_block + (slot % BLOCK_SIZE) * stride_c_slot
           + offs_h[:, None] * stride_c_head + offs_d[None, :])
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_c_kv, v, mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write key[t] and value[t] into kv_cache[0] and kv_cache[1] at slot slot_mapping[t] (in place)."""
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key and value must both be [num_tokens, num_kv_heads, head_size], got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    num_tokens, num_kv_heads, head_size = key.shape
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_size):
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, {num_kv_heads}, {head_size}], "
                         f"got {tuple(kv_cache.shape)}")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be [{num_tokens}] int32/int64, got {tuple(slot_mapping.shape)} "
                         f"{slot_mapping.dtype}")
    if kv_cache.dtype not in DTYPES or key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype:
        raise ValueError(f"key, value and kv_cache must share one dtype of {DTYPES}, got {key.dtype}, "
                         f"{value.dtype}, {kv_cache.dtype}")
    if key.stride(2) != 1 or value.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("key, value and kv_cache must be contiguous in head_size")
    check_device(_reshape_and_cache_kernel, key, value, kv_cache, slot_mapping)
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping.contiguous(),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, BLOCK_SIZE=kv_cache.shape[2],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_PAD=triton.next_power_of_2(head_size),
    )
