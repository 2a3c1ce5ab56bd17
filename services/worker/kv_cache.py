"""The paged KV cache: its one layout, and its sizing from a memory budget.

Layout, shared by the torch and Triton attention backends, the KV-block transfer and the block pool:
one tensor per layer,

    kv_cache[layer]: [2, num_blocks, block_size, num_kv_heads, head_size]
                      ^ 0 = K, 1 = V

Block b of the engine's block pool is `kv_cache[layer][:, b]` in every layer; token slot
`s = b * block_size + offset` is row `s` of `kv_cache[layer][0].view(-1, num_kv_heads, head_size)`.
Block 0 is a real block like any other (padding in block tables points at it and is masked).

On the CPU the cache is an anonymous mapping of its own per layer (`zeroed_host_memory`), not
torch.zeros: the kernel hands out zero pages as they are first written, so a cache of many GB costs
no start-up time and no resident memory until its blocks are used. Not huge pages: where the kernel
compacts memory for them on a fault (transparent_hugepage/defrag "madvise"), the steps that first
write a block stalled, and attention ran no faster on them.
"""

from __future__ import annotations

import mmap
from typing import NamedTuple

import torch

from services.worker import host_limits


class KVCacheSpec(NamedTuple):
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_size * itemsize


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return host_limits.available_bytes()


def num_blocks_for_budget(spec: KVCacheSpec, kv_cache_memory: int | None, memory_fraction: float,
                          device: torch.device) -> int:
    """How many blocks fit: `kv_cache_memory` bytes if given, else a fraction of free memory."""
    budget = kv_cache_memory if kv_cache_memory is not None else int(available_memory(device) * memory_fraction)
    num_blocks = budget // spec.bytes_per_block
    if num_blocks < 2:
        raise ValueError(
            f"KV-cache budget of {budget} bytes holds {num_blocks} blocks of {spec.bytes_per_block} bytes; "
            "raise kv_cache_memory"
        )
    return num_blocks


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    if device.type != "cpu":
        return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
    nbytes = spec.bytes_per_block * num_blocks // spec.num_layers
    return [zeroed_host_memory(nbytes).view(spec.dtype).view(shape) for _ in range(spec.num_layers)]


def zeroed_host_memory(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeros as a uint8 tensor over a private anonymous mapping of its own: page-aligned,
    zero by the kernel's guarantee (torch.empty may reuse freed heap), and neither written nor
    resident until used. Unmapped when the last tensor over it goes."""
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(memory, dtype=torch.uint8)
