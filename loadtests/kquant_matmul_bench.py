"""K-quant blocks (Q4_K, Q6_K: a Q4_K_M file's types) against Q4_1 in the quantized-weight kernel
(kvmesh_kernels/cpu_quant_matmul.py, `matmul`: the row-ordered tiles) at decode (1 row) and 32 rows:
microseconds a call and the weight bytes streamed per second, with torch's float32 `F.linear` beside.

Shapes (`--shapes`): `smollm2`, SmolLM2-135M's down (576x1536) and gate / up (1536x576); a K-quant
row holds whole 256-weight super-blocks, so 576 columns cannot be Q4_K: gate / up is timed at 1536x768
for every type. `gemma3`, Gemma 3 270M's Q4_K_M layers: o_proj (640x1024) and down (640x2048) in every
K-quant, beside its gate / up (4096x640, Q8_0 in the file: 640 columns are not whole super-blocks).

Weights are random blocks (sane float16 scales); as in a decode step the calls cycle through copies
worth `--stream-mib` of float32, so each call reads its weight from memory, not a warm cache.

    .venv/bin/python -m loadtests.kquant_matmul_bench
    .venv/bin/python -m loadtests.kquant_matmul_bench --threads 1 --isa avx2 --rows 1 8 32
    .venv/bin/python -m loadtests.kquant_matmul_bench --shapes gemma3 --rows 1 2 8 --threads 1
    .venv/bin/python -m loadtests.kquant_matmul_bench --shapes gemma3 --rows 2 32 --i8   # `--dtype auto`'s copies
"""

from __future__ import annotations

import argparse
import functools
import platform
import subprocess

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from kvmesh_kernels import cpu_quant_matmul as qm
from kvmesh_kernels.cpu_quant_matmul import QuantType
from loadtests.quant_matmul_bench import time_call
from services.common.config import default_cache_dir

K_TYPES = (QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K)
# --shapes -> (label, rows, columns, the types timed beside Q4_1)
SHAPES = {
    "smollm2": (("down 576x1536", 576, 1536, (QuantType.Q4_K, QuantType.Q6_K)),
                ("gate / up 1536x768", 1536, 768, (QuantType.Q4_K, QuantType.Q6_K))),
    "gemma3": (("o_proj 640x1024", 640, 1024, K_TYPES), ("down 640x2048", 640, 2048, K_TYPES),
               ("gate / up 4096x640", 4096, 640, (QuantType.Q8_0,))),
}
ROUNDS = 5


def random_weight(n: int, k: int, qtype: QuantType, rng: np.random.Generator) -> torch.Tensor:
    """[n, row_bytes] blocks of random weights near unit size."""
    if qtype in (QuantType.Q4_1, QuantType.Q8_0):
        values = rng.standard_normal((n, k), dtype=np.float32)
        blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType(qtype))
        return torch.from_numpy(blocks.view(np.uint8).reshape(n, -1))
    blocks = rng.integers(0, 256, size=(n, k // qm.K_BLOCK, qm.BLOCK_BYTES[qtype]), dtype=np.uint8)
    d = np.float16(1e-3).reshape(1).view(np.uint8)
    if qtype == QuantType.Q6_K:
        blocks[..., 208:210] = d
    else:
        blocks[..., 0:2], blocks[..., 2:4] = d, np.float16(1e-2).reshape(1).view(np.uint8)
    return torch.from_numpy(blocks.reshape(n, -1))


def cpu_name() -> str:
    lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    names = (line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name"))
    return next(names, platform.processor())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32], help="M values")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2", help="whose weight shapes")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--isa", default="native", help="the kernel build: native, avx2, scalar")
    parser.add_argument("--seconds", type=float, default=1.0, help="timing per cell, over its rounds")
    parser.add_argument("--stream-mib", type=int, default=256, help="float32 bytes the copies of a weight span")
    parser.add_argument("--i8", action="store_true",
                        help="also each type's int8-activation copy (`--dtype auto` on AVX2: to_i8_blocks)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lib = qm.variant(args.isa, default_cache_dir())
    print(f"{cpu_name()}: threads {args.threads}, kernel build {args.isa} (vector bits {qm.isa(lib)})")
    print("| shape | type | M | torch fp32 µs | kernel µs | kernel GB/s | µs ÷ Q4_1's |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rng = np.random.default_rng(0)
    for label, n, k, kinds in SHAPES[args.shapes]:
        types = (QuantType.Q4_1, *kinds)
        copies = max(2, args.stream_mib * 2**20 // (n * k * 4))
        floats = [torch.randn(n, k) for _ in range(copies)]
        weights = {qtype: [random_weight(n, k, qtype, rng) for _ in range(copies)] for qtype in types}
        # (label, weights, the type the kernel reads them as), by key: the file's blocks, then their copies
        rows = {qtype: (qtype.name, weights[qtype], qtype) for qtype in types}
        if args.i8:
            rows |= {(qtype, "i8"): (f"{qtype.name} as {qm.I8_OF[qtype].name}",
                                     [qm.to_i8_blocks(w, qtype, k, lib) for w in weights[qtype]], qm.I8_OF[qtype])
                     for qtype in types if qtype in qm.I8_OF}
        for m in args.rows:
            x = torch.randn(m, k)
            calls = {key: functools.partial(_matmul, x, blocks, qtype, k, lib) for key, (_, blocks, qtype) in rows.items()}
            calls[None] = lambda i: F.linear(x, floats[i])
            best = dict.fromkeys(calls, float("inf"))
            for _ in range(ROUNDS):  # the types interleaved, the best round each: a busy machine's noise
                for key, call in calls.items():
                    best[key] = min(best[key], time_call(call, copies, args.seconds / ROUNDS))
            for key, (name, blocks, _) in rows.items():
                t = best[key]
                print(f"| {label} | {name} | {m} | {best[None] * 1e6:.0f} | {t * 1e6:.0f} "
                      f"| {blocks[0].numel() / t / 1e9:.1f} | {t / best[QuantType.Q4_1]:.2f} |", flush=True)


def _matmul(x: torch.Tensor, blocks: list[torch.Tensor], qtype: QuantType, k: int, lib, i: int) -> torch.Tensor:
    return qm.matmul(x, blocks[i], qtype, k, lib)


if __name__ == "__main__":
    main()
