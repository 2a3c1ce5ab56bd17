"""Prompt attention on the CPU in float32 and with bfloat16 products (`--dtype auto` where the native
kernel has AVX512_BF16), two ways:

  1. The kernel alone: one prompt chunk of --rows rows whose last row sees --context tokens, with
     SmolLM2's and Gemma 3's heads, random data; best of --repeats calls per mode.
  2. With --served: the `LLM` (`--dtype auto`) reads one prompt of each --lengths token count (random
     token ids: nothing from the prefix cache) and writes one token, the two modes alternating
     (on, off, off, on) --passes times; best rate per mode and length, and each mode's share of its
     rate at the first length.

    .venv/bin/python -m loadtests.prompt_attention_bench
    .venv/bin/python -m loadtests.prompt_attention_bench --served --model gemma3-270m
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from kvmesh_kernels import cpu_paged_attention
from services.common.config import default_cache_dir

# (query heads, kv heads, head size)
HEADS = {"smollm2": (9, 3, 64), "gemma3-270m": (4, 1, 256)}
BLOCK_SIZE = 16


def kernel_times(heads: tuple[int, int, int], rows: int, context: int, repeats: int) -> dict[bool, float]:
    """Seconds of the best call per mode (prefill_bf16 off, on)."""
    num_heads, num_kv_heads, head_size = heads
    blocks = -(-context // BLOCK_SIZE)
    k = torch.randn(blocks, BLOCK_SIZE, num_kv_heads, head_size)
    v = torch.randn(blocks, BLOCK_SIZE, num_kv_heads, head_size)
    table = torch.randperm(blocks, dtype=torch.int32)[None].contiguous()
    q = torch.randn(rows, num_heads, head_size)
    row_lens = torch.arange(context - rows + 1, context + 1, dtype=torch.int32)
    seq_of_row = torch.zeros(rows, dtype=torch.int32)
    out = torch.empty_like(q)
    best = {False: float("inf"), True: float("inf")}
    for _ in range(repeats):
        for bf16 in best:
            start = time.perf_counter()
            cpu_paged_attention.paged_decode_attention(out, q, k, v, table, row_lens, head_size**-0.5,
                                                       seq_of_row=seq_of_row, prefill_bf16=bf16)
            best[bf16] = min(best[bf16], time.perf_counter() - start)
    return best


def served_rates(model: str, lengths: list[int], passes: int) -> dict[tuple[bool, int], list[float]]:
    from services import LLM, SamplingParams

    llm = LLM(model=model, dtype="auto", kv_cache_memory=2 << 30)
    backend = llm.worker.backend
    if not backend.prefill_bf16:
        raise SystemExit("this worker does not multiply prompt attention in bfloat16 (no AVX512_BF16 build)")
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([[rng.randrange(1000, 20000) for _ in range(300)]], params)  # warm-up
    rates: dict[tuple[bool, int], list[float]] = {}
    for _ in range(passes):
        for bf16 in (True, False, False, True):
            backend.prefill_bf16 = bf16
            for n in lengths:
                prompt = [rng.randrange(1000, 20000) for _ in range(n)]
                start = time.perf_counter()
                llm.generate([prompt], params)
                rates.setdefault((bf16, n), []).append(n / (time.perf_counter() - start))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--served", action="store_true")
    parser.add_argument("--model", default="smollm2", choices=list(HEADS))
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 8000])
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu_paged_attention.build(default_cache_dir())
    if not cpu_paged_attention.prefill_bf16_built():
        raise SystemExit("the native attention kernel has no bfloat16 products on this CPU (AVX512_BF16)")
    if args.served:
        rates = served_rates(args.model, args.lengths, args.passes)
        print("| prompt tokens | float32 tok/s | bfloat16 products tok/s |")
        print("| ---: | ---: | ---: |")
        first = {bf16: max(rates[(bf16, args.lengths[0])]) for bf16 in (False, True)}
        for n in args.lengths:
            best = {bf16: max(rates[(bf16, n)]) for bf16 in (False, True)}
            cells = [f"{best[bf16]:,.0f} ({best[bf16] / first[bf16]:.0%})" for bf16 in (False, True)]
            print(f"| {n:,} | {cells[0]} | {cells[1]} |")
        return
    print(f"One chunk of {args.rows} rows at {args.context:,} tokens of context, {torch.get_num_threads()} threads")
    print("| heads | float32 | bfloat16 products |")
    print("| --- | ---: | ---: |")
    for name, heads in HEADS.items():
        num_heads, _, head_size = heads
        flop = 4 * args.rows * num_heads * head_size * (args.context - args.rows / 2)
        t = kernel_times(heads, args.rows, args.context, args.repeats)
        cells = [f"{t[bf16] * 1e3:.1f} ms, {flop / t[bf16] / 1e9:.0f} GFLOP/s" for bf16 in (False, True)]
        print(f"| {name} {heads} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
