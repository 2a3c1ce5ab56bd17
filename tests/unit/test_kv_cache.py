"""services/worker/kv_cache.py on the CPU: a cache sized from free memory is zero, costs no resident
memory until its blocks are written, and gives its memory back when the worker drops it."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.worker.kv_cache import KVCacheSpec, allocate_kv_caches

CPU = torch.device("cpu")
MiB = 2**20


def anon_rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


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
    gc.collect()
    before = anon_rss()
    caches = allocate_kv_caches(spec, num_blocks, CPU)
    assert anon_rss() - before < 16 * MiB  # 512 MiB asked for, nothing written yet

    for cache in caches:  # the blocks a few requests use, in every layer
        cache[:, :64] = 1.0
    written = 4 * 64 * spec.bytes_per_block // spec.num_layers
    grown = anon_rss() - before
    assert written <= grown < written + 16 * MiB
    assert not caches[3][:, 64:].any()  # the rest still reads zero

    del caches, cache
    gc.collect()
    assert anon_rss() - before < 16 * MiB  # unmapped with the last tensor over it

