"""The paged KV cache: its one layout, and its sizing from a memory budget.

Layout, shared by the torch and Triton attention backends, the KV-block transfer and the block pool:
one tensor per layer,

    kv_cache[layer]: [2, num_blocks, block_size, num_kv_heads, head_size]
                      ^ 0 = K, 1 = V

Block b of the engine's block pool is `kv_cache[layer][:, b]` in every layer; token slot
`s = b * block_size + offset` is row `s` of `kv_cache[layer][0].view(-1, num_kv_heads, head_size)`.
Block 0 is a real block like any other (padding in block tables points at it and is masked).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


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
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


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
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
