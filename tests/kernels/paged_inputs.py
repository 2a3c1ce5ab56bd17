"""Random paged-attention inputs for the kernel tests: a cache poisoned with NaN everywhere no
request's context lives, contexts in shuffled blocks (block 0 included, so the 0-padding of block
tables points at somebody's real data), and fresh random values for every case."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvmesh_kernels.paged_attention import PagedBatch

# Absolute and relative tolerances against the float32 reference. The kernels round the softmax
# probabilities to the cache dtype for the value product (as the tensor cores take them) and round
# the output once; the reference rounds only the output. float32 differs by summation order only.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),  # ~4 float16 ulps at 1.0
    torch.bfloat16: (3e-2, 2e-2),  # ~4 bfloat16 ulps at 1.0
}


class Shape(NamedTuple):
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype


class PagedCase(NamedTuple):
    q: torch.Tensor  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_size]
    batch: PagedBatch


def make_case(shape: Shape, q_lens: list[int], seq_lens: list[int], device: torch.device,
              gen: torch.Generator) -> PagedCase:
    """Request i has seq_lens[i] tokens of context, the last q_lens[i] of them new in this step."""
    bs = shape.block_size
    blocks_per_req = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 2  # two spare blocks nobody owns, left as NaN
    order = torch.randperm(num_blocks, generator=gen, device=device).cpu().tolist()
    tables, used = [], 0
    for n in blocks_per_req:
        tables.append(order[used : used + n])
        used += n
    width = max(max(blocks_per_req), 1)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)

    cache_shape = (2, num_blocks, bs, shape.num_kv_heads, shape.head_size)
    kv_cache = torch.full(cache_shape, float("nan"), dtype=shape.dtype, device=device)
    slots = torch.cat([
        torch.tensor(t, dtype=torch.long)[torch.arange(s) // bs] * bs + torch.arange(s) % bs
        for t, s in zip(tables, seq_lens)
    ]).to(device)
    flat = kv_cache.view(2, num_blocks * bs, shape.num_kv_heads, shape.head_size)
    values = torch.randn((2, slots.numel(), shape.num_kv_heads, shape.head_size), generator=gen, device=device)
    flat[:, slots] = values.to(shape.dtype)

    q = torch.randn((sum(q_lens), shape.num_heads, shape.head_size), generator=gen, device=device).to(shape.dtype)
    query_start_loc = torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    batch = PagedBatch(query_start_loc, seq_lens_t, block_table, max(q_lens, default=0), max(seq_lens, default=0))
    return PagedCase(q, kv_cache, batch)


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN: any element the kernel fails to write stays NaN."""
    return torch.full_like(t, float("nan"))
