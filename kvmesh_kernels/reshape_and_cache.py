"""KV-cache write: the step's new K and V rows go into their paged-cache slots.

    key, value:   [num_tokens, num_kv_heads, head_size]
    slot_mapping: [num_tokens]  slot = block_id * block_size + offset; -1 = padding, skipped
    kv_cache:     [2, num_blocks, block_size, num_kv_heads, head_size]  (services/worker/kv_cache.py)

A program copies a few whole tokens (all heads); the reference is
`kvmesh_kernels.reference.reshape_and_cache_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmesh_kernels.interpreter import check_device

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TILE_ELEMENTS = 4096  # elements of K (and of V) one program moves: 4 tokens of 8 heads x 128
MAX_TOKENS_PER_PROGRAM = 32


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, kv_cache_ptr, slot_mapping_ptr, num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
):
    # A tile of BLOCK_T tokens x (heads * head_size) elements, the heads flattened into one axis.
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    slot = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    e = tl.arange(0, HEADS_PAD * HEAD_PAD)
    h = e // HEAD_PAD
    d = e % HEAD_PAD
    mask = (slot >= 0)[:, None] & ((h < NUM_KV_HEADS) & (d < HEAD_SIZE))[None, :]
    row = tokens.to(tl.int64)[:, None]
    k = tl.load(key_ptr + row * stride_kt + (h * stride_kh + d)[None, :], mask=mask)
    v = tl.load(value_ptr + row * stride_vt + (h * stride_vh + d)[None, :], mask=mask)
    dst = (kv_cache_ptr + ((slot // BLOCK_SIZE) * stride_c_block + (slot % BLOCK_SIZE) * stride_c_slot)[:, None]
           + (h * stride_c_head + d)[None, :])
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
    heads_pad, head_pad = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_size)
    block_t = max(1, min(MAX_TOKENS_PER_PROGRAM, TILE_ELEMENTS // (heads_pad * head_pad)))
    _reshape_and_cache_kernel[(triton.cdiv(num_tokens, block_t),)](
        key, value, kv_cache, slot_mapping.contiguous(), num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, BLOCK_SIZE=kv_cache.shape[2], BLOCK_T=block_t,
        HEADS_PAD=heads_pad, HEAD_PAD=head_pad,
    )
