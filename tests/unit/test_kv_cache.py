"""services/worker/kv_cache.py on the CPU: a cache sized from free memory is zero, costs no resident
memory until its blocks are written, and gives its memory back when the worker drops it."""

from __future__ import annotations

import ctypes
import errno
import gc
import mmap

import pytest
import torch

from services.worker.kv_cache import KVCacheSpec, allocate_kv_caches

CPU = torch.device("cpu")
MiB = 2**20


_libc = ctypes.CDLL(None, use_errno=True)


def resident_bytes(address: int, length: int) -> int | None:
    """The bytes of [address, address + length) in memory (mincore(2): these pages alone, whatever
    other threads of the process allocate); None where the range is not mapped."""
    pages = -(-length // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), vector) != 0:
        assert ctypes.get_errno() == errno.ENOMEM, errno.errorcode[ctypes.get_errno()]
        return None
    return sum(byte & 1 for byte in vector) * mmap.PAGESIZE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_layout_and_zeros(dtype: torch.dtype) -> None:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_size=8, block_size=4, dtype=dtype)
    caches = allocate_kv_caches(spec, 5, CPU)
    assert len(caches) == 3
    for cache in caches:
        assert cache.shape == (2, 5, 4, 2, 8) and cache.dtype == dtype and cache.is_contiguous()
        assert cache.data_ptr() % 4096 == 0  # a mapping of its own, page-aligned
        assert not cache.any()
    caches[0][1, 4] = 1.5  # layers do not share memory
    assert caches[0].sum() == 1.5 * 4 * 2 * 8 and not caches[1].any() and not caches[2].any()
    assert sum(c.nbytes for c in caches) == 5 * spec.bytes_per_block


def test_a_large_cache_is_resident_only_where_written_and_freed_when_dropped() -> None:
    spec = KVCacheSpec(num_layers=4, num_kv_heads=4, head_size=64, block_size=16, dtype=torch.float32)
    num_blocks = 512 * MiB // spec.bytes_per_block
    caches = allocate_kv_caches(spec, num_blocks, CPU)
    spans = [(cache.data_ptr(), cache.nbytes) for cache in caches]
    assert [resident_bytes(*span) for span in spans] == [0] * 4  # 512 MiB asked for, nothing written yet

    for cache in caches:  # the blocks a few requests use, in every layer
        cache[:, :64] = 1.0
    written = 64 * spec.bytes_per_block // spec.num_layers  # K and V of 64 blocks, per layer
    for span in spans:
        assert written <= resident_bytes(*span) <= written + 2 * mmap.PAGESIZE  # those pages, no more
    assert not caches[3][:, 64:].any()  # the rest still reads zero

    del caches, cache
    gc.collect()
    assert [resident_bytes(*span) for span in spans] == [None] * 4  # unmapped with the last tensor over it
