"""Batched LoRA on the CPU: one shrink + expand pair (a hidden x hidden layer, SmolLM2's o_proj at 576)
by the native kernels in each build this CPU runs ("native avx2"...) against the per-segment torch
reference ("reference"), and a plain torch pair as if the whole batch had one adapter ("one adapter":
the floor of what per-segment torch could reach). Each cell: microseconds a pair (the median of a round
of calls, the best of 5 rounds) and the speed-up over the reference; a comparison of code paths on one
machine, not a serving number.

    decode   8 one-row segments over 4 adapters
    prefill  one 512-row segment

    .venv/bin/python -m loadtests.lora_kernels
    .venv/bin/python -m loadtests.lora_kernels --ranks 8 16 64 --hidden 2048 --repeats 100 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, NamedTuple

import torch

from kvmesh_kernels import cpu_lora, native
from kvmesh_kernels.reference import lora_expand_ref, lora_shrink_ref
from services.common.config import default_cache_dir

NUM_SLOTS = 4


class Shape(NamedTuple):
    name: str
    seg_lens: list[int]
    seg_slots: list[int]


SHAPES = (Shape("decode 8x1", [1] * 8, [0, 1, 2, 3, 0, 1, 2, 3]), Shape("prefill 1x512", [512], [2]))


ROUNDS = 5


def median_us(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each function's median over repeats // ROUNDS calls, the best of ROUNDS rounds that take the
    functions in turn: a burst of load on a shared machine spoils a round, not a function's number."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            times = []
            for _ in range(max(1, repeats // ROUNDS)):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            best[name] = min(best[name], 1e6 * statistics.median(times))
    return best


def pair_rows(shape: Shape, hidden: int, rank: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    num_rows = sum(shape.seg_lens)
    x = torch.randn(num_rows, hidden, generator=gen).to(dtype)
    a = (torch.randn(NUM_SLOTS, rank, hidden, generator=gen) / hidden**0.5).to(dtype)
    b = (torch.randn(NUM_SLOTS, hidden, rank, generator=gen) / rank**0.5).to(dtype)
    out = torch.zeros(num_rows, hidden, dtype=dtype)
    indptr = torch.tensor([0, *torch.tensor(shape.seg_lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.tensor(shape.seg_slots, dtype=torch.int32)

    def reference() -> None:
        lora_expand_ref(out, lora_shrink_ref(x, a, indptr, slots), b, indptr, slots, 0)

    def one_adapter() -> None:
        out.add_(((x @ a[0].T) @ b[0].T))

    fns = {"reference": reference, "one adapter": one_adapter}
    for isa in native.ISA_FLAGS:
        if native.runs_here(isa):
            lib = cpu_lora.variant(isa, default_cache_dir())

            def native_pair(lib=lib) -> None:
                y = torch.empty(num_rows, rank)
                cpu_lora.lora_shrink(y, x, a, indptr, slots, lib=lib)
                cpu_lora.lora_expand(out, y, b, indptr, slots, lib=lib)

            fns[f"native {isa}"] = native_pair
    return median_us(fns, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's and the kernels' threads (1: stable on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_lora.available(default_cache_dir()):
        raise SystemExit("the native LoRA kernels did not build (is gcc installed?)")
    print(f"shrink + expand, hidden {args.hidden}, {NUM_SLOTS} adapters, {torch.get_num_threads()} threads, "
          f"us, best of {ROUNDS} medians of {args.repeats // ROUNDS} calls")
    header = None
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES:
            for rank in args.ranks:
                rows = pair_rows(shape, args.hidden, rank, dtype, args.repeats)
                if header is None:
                    header = f"{'dtype':9} {'batch':14} {'rank':4} " + " ".join(f"{name:>15}" for name in rows)
                    print(header)
                ref = rows["reference"]
                cells = " ".join(f"{us:8.1f} ({ref / us:4.1f}x)" for us in rows.values())
                print(f"{str(dtype).removeprefix('torch.'):9} {shape.name:14} {rank:4} {cells}")

if __name__ == "__main__":
    main()
