"""The KV-cache write kernel against the plain-torch reference: exact copies into the right slots,
padding slots (-1) skipped, every other cache element left as it was (the cache starts as NaN)."""

from __future__ import annotations

import pytest
import torch

from kvmesh_kernels.reference import reshape_and_cache_ref
from kvmesh_kernels.reshape_and_cache import reshape_and_cache


def write_and_check(key: torch.Tensor, value: torch.Tensor, num_blocks: int, block_size: int,
                    slot_mapping: torch.Tensor) -> torch.Tensor:
    cache_shape = (2, num_blocks, block_size, key.shape[1], key.shape[2])
    cache = torch.full(cache_shape, float("nan"), dtype=key.dtype, device=key.device)
    expected = cache.clone()
    reshape_and_cache(key, value, cache, slot_mapping)
    reshape_and_cache_ref(key, value, expected, slot_mapping)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0, equal_nan=True)
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads,head_size", [(1, 64), (3, 64), (8, 128)])
@pytest.mark.parametrize("num_tokens", [1, 17, 100])
def test_writes_every_token_to_its_slot(num_tokens: int, num_kv_heads: int, head_size: int, block_size: int,
                                        dtype: torch.dtype, device, gen) -> None:
    num_blocks = -(-num_tokens // block_size) + 3
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=device)[:num_tokens]
    key = torch.randn((num_tokens, num_kv_heads, head_size), generator=gen, device=device).to(dtype)
    value = torch.randn((num_tokens, num_kv_heads, head_size), generator=gen, device=device).to(dtype)
    cache = write_and_check(key, value, num_blocks, block_size, slots)
    assert cache.isnan().sum() == 2 * (num_blocks * block_size - num_tokens) * num_kv_heads * head_size


def test_padding_slots_are_skipped(device, gen) -> None:
    slots = torch.tensor([5, -1, 17, -1, -1, 0], device=device)
    key = torch.randn((6, 2, 64), generator=gen, device=device)
    value = torch.randn((6, 2, 64), generator=gen, device=device)
    cache = write_and_check(key, value, num_blocks=2, block_size=16, slot_mapping=slots)
    assert torch.equal(cache[0, 1, 1], key[2]) and torch.equal(cache[1, 0, 0], value[5])
    assert cache.isnan().sum() == 2 * (32 - 3) * 2 * 64


def test_key_and_value_as_views_of_the_fused_projection(device, gen) -> None:
    # As the model hands them over: strided views into one [num_tokens, (H + 2 Hkv) * D] tensor.
    num_heads, num_kv_heads, head_size = 4, 2, 64
    qkv = torch.randn((9, (num_heads + 2 * num_kv_heads) * head_size), generator=gen, device=device)
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    key = qkv[:, q_size : q_size + kv_size].view(9, num_kv_heads, head_size)
    value = qkv[:, q_size + kv_size :].view(9, num_kv_heads, head_size)
    assert not key.is_contiguous()
    slots = torch.arange(3, 12, dtype=torch.int32, device=device)
    write_and_check(key, value, num_blocks=1, block_size=16, slot_mapping=slots)


def test_no_tokens(device) -> None:
    empty = torch.empty((0, 2, 64), device=device)
    write_and_check(empty, empty, num_blocks=1, block_size=16,
                    slot_mapping=torch.empty(0, dtype=torch.long, device=device))


def test_launcher_rejects_bad_inputs(device) -> None:
    key = torch.zeros((3, 2, 64), device=device)
    cache = torch.zeros((2, 1, 16, 2, 64), device=device)
    slots = torch.arange(3, device=device)
    with pytest.raises(ValueError, match="share one dtype"):
        reshape_and_cache(key.half(), key.half(), cache, slots)
    with pytest.raises(ValueError, match="kv_cache must be"):
        reshape_and_cache(key, key, cache[:, :, :, :1], slots)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        reshape_and_cache(key, key, cache, slots.float())
    with pytest.raises(ValueError, match="slot_mapping must be"):
        reshape_and_cache(key, key, cache, slots[:2])
    with pytest.raises(ValueError, match="key and value"):
        reshape_and_cache(key, key[:2], cache, slots)
    with pytest.raises(ValueError, match="contiguous in head_size"):
        reshape_and_cache(key.transpose(1, 2).contiguous().transpose(1, 2), key, cache, slots)
