"""The native CPU kernels in each build this CPU runs (native, AVX2 + FMA, scalar) against the torch
ops they replace (prefill attention: the torch backend's SDPA over the gathered blocks), at the
default model's shapes (SmolLM2-135M: 9 query heads, 3 KV heads, head size
64, hidden 576), float32 and bfloat16. Median microseconds of --repeats calls; for a
comparison of code paths on one machine, not a serving number.

    .venv/bin/python -m loadtests.kernel_bench                       # decode batches 1, 8, 32
    .venv/bin/python -m loadtests.kernel_bench --batches 8 --context 1024 --repeats 50
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F

from kvmesh_kernels import cpu_fused_ops, cpu_paged_attention, native
from kvmesh_kernels.reference import paged_attention_ref
from services.common.config import default_cache_dir
from services.worker.attention.metadata import AttentionMetadata
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.layers.rotary_embedding import apply_rotary

H, HKV, D, HIDDEN, BLOCK = 9, 3, 64, 576, 16


def median_us(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def attention_rows(batch: int, context: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-context // BLOCK)
    table = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq).int()
    cache = torch.randn((2, batch * per_seq, BLOCK, HKV, D), generator=gen).to(dtype)
    q = torch.randn((batch, H, D), generator=gen).to(dtype)
    lens = torch.full((batch,), context, dtype=torch.int32)
    out = torch.empty_like(q)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    rows = {"torch (reference gather + SDPA)": median_us(
        lambda: paged_attention_ref(q, cache, starts, lens, table, D**-0.5), max(3, repeats // 10))}
    for isa in native.ISA_FLAGS:
        if native.runs_here(isa):
            lib = cpu_paged_attention.variant(isa, default_cache_dir())
            rows[isa] = median_us(lambda: cpu_paged_attention.paged_decode_attention(
                out, q, cache[0], cache[1], table, lens, D**-0.5, lib=lib), repeats)
    return rows


def prefill_rows(length: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """One request's whole prompt of `length` tokens: the torch backend's SDPA over its gathered
    blocks (with the causal mask its plan builds) against the native kernel, a row per token."""
    gen = torch.Generator().manual_seed(2)
    num_blocks = -(-length // BLOCK)
    cache = torch.randn((2, num_blocks, BLOCK, HKV, D), generator=gen).to(dtype)
    q = torch.randn((length, H, D), generator=gen).to(dtype)
    k, v = torch.randn((2, length, HKV, D), generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen).view(1, -1).int()
    positions = torch.arange(length)
    meta = AttentionMetadata(
        num_tokens=length, num_reqs=1, query_start_loc=torch.tensor([0, length], dtype=torch.int32),
        seq_lens=torch.tensor([length], dtype=torch.int32), positions=positions,
        slot_mapping=table[0, positions // BLOCK].long() * BLOCK + positions % BLOCK, block_table=table,
        block_size=BLOCK, max_query_len=length, max_seq_len=length, query_lens_cpu=[length],
        seq_lens_cpu=[length])
    layer = SimpleNamespace(num_heads=H, num_kv_heads=HKV, head_size=D, scale=D**-0.5, sliding_window=None,
                            logits_soft_cap=None)
    backend = TorchAttentionBackend()
    plan = backend.plan(meta)
    rows = {"torch backend (SDPA)": median_us(lambda: backend.forward(layer, q, k, v, cache, plan), repeats)}
    row_lens = (positions + 1).int()
    seq_of_row = torch.zeros(length, dtype=torch.int32)
    out = torch.empty_like(q)
    for isa in native.ISA_FLAGS:
        if native.runs_here(isa):
            lib = cpu_paged_attention.variant(isa, default_cache_dir())
            rows[isa] = median_us(lambda: cpu_paged_attention.paged_decode_attention(
                out, q, cache[0], cache[1], table, row_lens, D**-0.5, lib=lib, seq_of_row=seq_of_row), repeats)
    return rows


def rope_rows(n: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(n, (H + 2 * HKV) * D, generator=gen).to(dtype)
    cos_sin = torch.randn(n, D, generator=gen).to(dtype)
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)

    def torch_rope() -> None:
        apply_rotary(qkv[:, : H * D].view(n, H, D), cos, sin)
        apply_rotary(qkv[:, H * D : (H + HKV) * D].view(n, HKV, D), cos, sin)

    rows = {"torch": median_us(torch_rope, repeats)}
    for isa in native.ISA_FLAGS:
        if native.runs_here(isa):
            lib = cpu_fused_ops.variant(isa, default_cache_dir())
            rows[isa] = median_us(lambda: cpu_fused_ops.rope_inplace(qkv, cos_sin, H + HKV, D, lib=lib), repeats)
    return rows


def kv_write_rows(n: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    cache = torch.zeros((2, 256, BLOCK, HKV, D), dtype=dtype)
    k, v = torch.randn(2, n, HKV, D).to(dtype)
    slots = torch.randperm(256 * BLOCK)[:n]
    k_flat, v_flat = cache[0].view(-1, HKV, D), cache[1].view(-1, HKV, D)
    rows = {"torch (2 index_copy_)": median_us(
        lambda: (k_flat.index_copy_(0, slots, k), v_flat.index_copy_(0, slots, v)), repeats)}
    for isa in native.ISA_FLAGS:
        if native.runs_here(isa):
            lib = cpu_fused_ops.variant(isa, default_cache_dir())
            rows[isa] = median_us(lambda: cpu_fused_ops.kv_write(cache[0], cache[1], k, v, slots, lib=lib), repeats)
    return rows


def rms_norm_rows(n: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    x = torch.randn(n, HIDDEN).to(dtype)
    weight = torch.randn(HIDDEN).to(dtype)
    if dtype == torch.float32:
        rows = {"torch (F.rms_norm)": median_us(lambda: F.rms_norm(x, (HIDDEN,), weight, 1e-5), repeats)}
    else:
        rows = {"torch (as the layer)": median_us(
            lambda: weight * F.rms_norm(x.float(), (HIDDEN,), None, 1e-5).to(dtype), repeats)}
    for isa in native.ISA_FLAGS:
        if native.runs_here(isa):
            lib = cpu_fused_ops.variant(isa, default_cache_dir())
            rows[isa] = median_us(lambda: cpu_fused_ops.rms_norm(x, weight, 1e-5, lib=lib), repeats)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=512, help="decode attention's context per sequence")
    parser.add_argument("--prefill", type=int, nargs="*", default=[128, 1024], help="prompt lengths")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()}; median us per call")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for length in args.prefill:
            cells = "  ".join(f"{name} {us:9.1f}" for name, us in
                              prefill_rows(length, dtype, max(3, args.repeats // 20)).items())
            print(f"{dtype_name:8s} prompt {length:4d}  {'prefill attention':30s} {cells}")
        for batch in args.batches:
            for op, rows in (
                (f"decode attention, context {args.context}", attention_rows(batch, args.context, dtype, args.repeats)),
                ("rope (q and k)", rope_rows(batch, dtype, args.repeats)),
                ("kv write", kv_write_rows(batch, dtype, args.repeats)),
                ("rms norm", rms_norm_rows(batch, dtype, args.repeats)),
            ):
                cells = "  ".join(f"{name} {us:9.1f}" for name, us in rows.items())
                print(f"{dtype_name:8s} batch {batch:3d}  {op:30s} {cells}")


if __name__ == "__main__":
    main()
