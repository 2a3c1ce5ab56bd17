"""One layer's decode attention for decodes that share a prompt prefix (the shared-prefix scenario's
steps), on the native kernel (kvmesh_kernels/cpu/paged_decode_attention.c): B decodes with the default
model's heads (9 query, 3 kv, head size 64), a --prefix-token prefix in blocks they all hold (the
prefix cache's), --own tokens each of their own after it; and the same contexts with no block in
common. With --prefill N instead: one N-token prompt read as one chunk (each token a row attending
its causal context). p50 and min of --calls calls, ms.

    .venv/bin/python -m loadtests.prefix_attention_bench
    .venv/bin/python -m loadtests.prefix_attention_bench --isa avx2 --threads 1
    .venv/bin/python -m loadtests.prefix_attention_bench --before old.so   # a build of another source, alternating
    .venv/bin/python -m loadtests.prefix_attention_bench --isa avx2 --prefill 1000 --calls 30 --before old.so

With --before PATH (a library compiled from another version of the source, e.g. the previous commit's
with the flags kvmesh_kernels/native.py uses), its calls alternate with this build's and the outputs are
compared bit for bit.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch

from kvmesh_kernels import cpu_paged_attention
from services.common.config import default_cache_dir

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 9, 3, 64, 16


def case(batch: int, prefix: int, own: int, shared: bool) -> tuple[torch.Tensor, ...]:
    """q, K and V caches, block table and row lengths for `batch` decodes of prefix + own + 1 tokens."""
    gen = torch.Generator().manual_seed(0)
    per_row = -(-(prefix + own + 1) // BLOCK_SIZE)
    prefix_blocks = prefix // BLOCK_SIZE
    num_blocks = batch * per_row + 8
    k = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, generator=gen)
    v = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)  # blocks scattered, as a pool hands them out
    table = torch.zeros(batch, per_row, dtype=torch.int32)
    taken = prefix_blocks if shared else 0
    for b in range(batch):
        own_blocks = per_row - prefix_blocks if shared else per_row
        if shared:
            table[b, :prefix_blocks] = order[:prefix_blocks]
        table[b, per_row - own_blocks:] = order[taken : taken + own_blocks]
        taken += own_blocks
    lens = torch.full((batch,), prefix + own + 1, dtype=torch.int32)
    return torch.randn(batch, HEADS, HEAD_SIZE, generator=gen), k, v, table, lens


def prefill_case(tokens: int) -> tuple[torch.Tensor, ...]:
    """q, K and V caches, block table, row lengths and rows' request for one `tokens`-token prompt."""
    gen = torch.Generator().manual_seed(0)
    num_blocks = -(-tokens // BLOCK_SIZE) + 4
    k = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, generator=gen)
    v = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, generator=gen)
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32)[None, :].contiguous()
    lens = torch.arange(1, tokens + 1, dtype=torch.int32)  # row t attends positions 0 .. t
    return torch.randn(tokens, HEADS, HEAD_SIZE, generator=gen), k, v, table, lens, torch.zeros(tokens, dtype=torch.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", default="native", help="the kernel build: native, avx2, scalar")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=1504)
    parser.add_argument("--own", type=int, default=48)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--prefill", type=int, default=None, help="one prompt of this many tokens instead of decodes")
    parser.add_argument("--before", default=None, help="a library of another source to alternate with")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    libs = {"this build": cpu_paged_attention.variant(args.isa, default_cache_dir())}
    if args.before:
        libs = {"before": cpu_paged_attention._declare(ctypes.CDLL(args.before)), **libs}
    for shared in (True, False) if args.prefill is None else (None,):
        if shared is None:
            q, k, v, table, lens, rows = prefill_case(args.prefill)
        else:
            (q, k, v, table, lens), rows = case(args.batch, args.prefix_tokens, args.own, shared), None
        outs = {name: torch.empty_like(q) for name in libs}
        times: dict[str, list[float]] = {name: [] for name in libs}
        for _ in range(args.calls):
            for name, lib in libs.items():
                start = time.perf_counter()
                cpu_paged_attention.paged_decode_attention(outs[name], q, k, v, table, lens, HEAD_SIZE**-0.5, lib=lib,
                                                           seq_of_row=rows)
                times[name].append(time.perf_counter() - start)
        cells = []
        for name, ts in times.items():
            ts.sort()
            cells.append(f"{name} p50 {ts[len(ts) // 2] * 1e3:.3f} ms, min {ts[0] * 1e3:.3f} ms")
        same = "" if len(outs) == 1 else (f"; outputs bit-equal: {torch.equal(*outs.values())}, largest difference "
                                          f"{(outs['before'] - outs['this build']).abs().max().item():.1e}")
        what = (f"one {args.prefill}-token prompt" if shared is None else
                f"{args.batch} decodes at {args.prefix_tokens + args.own + 1} tokens, "
                f"{'shared prefix' if shared else 'no shared blocks'}")
        print(f"{args.isa}, {args.threads} threads, {what}: {'; '.join(cells)}{same}", flush=True)


if __name__ == "__main__":
    main()
