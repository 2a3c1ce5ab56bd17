"""torch's float32 `F.linear` against the quantized-weight kernel (kvmesh_kernels/cpu_quant_matmul.py) at
the default model's weight shapes, with the weights of its GGUF file (SmolLM2-135M Q4_1, LM head
Q8_0): per shape and M, microseconds a call and the weight bytes streamed per second.

    kernel     the native tiles over the file's row-ordered blocks (`matmul`: the LM head's path)
    packed     Q4_1 only: the same weights repacked for the kernel (`pack`, `matmul_packed`: the
               layers' decode path), lanes across 16 output rows
    deq+gemm   `dequantize` then torch's GEMM, the path from GEMM_ROWS up (`linear`)
    i8         the same weights as Q4_1_I8 / Q8_0_I8 (`to_i8_blocks`) against x quantized to int8
               per 32-block (`--dtype auto`'s layers and LM head without bfloat16 dot products,
               from 2 rows)

As in a decode step, where each weight is read once and the model is far larger than the caches,
the calls cycle through copies of the weight worth `--stream-mib` of float32 (default 384 MiB),
so that every call reads its weight from memory, not from a cache a previous call warmed.

Run from the repository root (a few seconds a row):

    .venv/bin/python -m loadtests.quant_matmul_bench
    .venv/bin/python -m loadtests.quant_matmul_bench --rows 1 8 32 64 128 --threads 2 --isa avx2
    .venv/bin/python -m loadtests.quant_matmul_bench --shapes lm_head --rows 1 2 8 32 --isa avx2
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvmesh_kernels import cpu_quant_matmul as qm
from services.common.config import default_cache_dir
from services.common.gguf_file import GGUFFile
from services.common.model_files import locate_model

# (name, GGUF tensor): the projections of one layer and the LM head (the tied embedding).
SHAPES = (
    ("q_proj / o_proj 576x576", "blk.0.attn_q.weight"),
    ("k_proj / v_proj 192x576", "blk.0.attn_k.weight"),
    ("gate / up 1536x576", "blk.0.ffn_gate.weight"),
    ("down 576x1536", "blk.0.ffn_down.weight"),
    ("lm_head 49152x576", "token_embd.weight"),
)


def time_call(fn: Callable[[int], object], copies: int, seconds: float) -> float:
    """Mean seconds a call `fn(copy)` over ~`seconds` of calls, the copies in turn, after a warm-up
    round."""
    for i in range(copies):
        fn(i)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or calls < copies:
        fn(calls % copies)
        calls += 1
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128], help="M values")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--isa", default="native", help="the kernel build: native, avx2, scalar")
    parser.add_argument("--seconds", type=float, default=0.3, help="timing per cell")
    parser.add_argument("--shapes", nargs="+", default=None,
                        help="only the shapes whose name starts with one of these (e.g. lm_head)")
    parser.add_argument("--stream-mib", type=int, default=384, help="float32 bytes the copies of a weight span")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lib = qm.variant(args.isa, default_cache_dir())
    tensors = GGUFFile(locate_model("smollm2")).tensors
    print(f"threads {args.threads}, kernel build {args.isa} (vector bits {qm.isa(lib)})")
    print(f"int8 sums: {qm.i8_path(lib)}")
    print("| shape | type | M | torch fp32 µs | kernel µs | packed µs | i8 µs | deq+gemm µs | torch GB/s | kernel GB/s "
          "| kernel ÷ torch | packed ÷ kernel | i8 ÷ kernel |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, name in SHAPES:
        if args.shapes and not label.startswith(tuple(args.shapes)):
            continue
        t = tensors[name]
        data = t.data.reshape(t.shape[1], -1)  # [rows, bytes a row]: GGUF lists the fastest dimension first
        qtype = qm.QuantType(int(t.tensor_type))
        k = data.shape[1] // qm.BLOCK_BYTES[qtype] * qm.BLOCK
        copies = max(1, args.stream_mib * 2**20 // (data.shape[0] * k * 4))
        blocks = [torch.from_numpy(data.copy()) for _ in range(copies)]
        weights = [qm.dequantize(b, qtype, k, lib) for b in blocks]
        n = data.shape[0]
        packs = [qm.pack(b, qtype, k, lib) for b in blocks] if qtype in qm.PACKABLE else None
        i8s = [qm.to_i8_blocks(b, qtype, k, lib) for b in blocks] if qtype in qm.I8_OF else None
        for m in args.rows:
            x = torch.randn(m, k)
            t_torch = time_call(lambda i: F.linear(x, weights[i]), copies, args.seconds)
            t_kernel = time_call(lambda i: qm.matmul(x, blocks[i], qtype, k, lib), copies, args.seconds)
            t_packed = (time_call(lambda i: qm.matmul_packed(x, packs[i], n, k, lib), copies, args.seconds)
                        if packs else None)
            t_i8 = (time_call(lambda i: qm.matmul(x, i8s[i], qm.I8_OF[qtype], k, lib), copies, args.seconds)
                    if i8s else None)
            t_deq = time_call(lambda i: F.linear(x, qm.dequantize(blocks[i], qtype, k, lib)), copies, args.seconds)
            packed = f"{t_packed * 1e6:.0f}" if t_packed else "-"
            speedup = f"{t_kernel / t_packed:.2f}x" if t_packed else "-"
            i8 = f"{t_i8 * 1e6:.0f}" if t_i8 else "-"
            i8_speedup = f"{t_kernel / t_i8:.2f}x" if t_i8 else "-"
            print(f"| {label} | {qtype.name} | {m} | {t_torch * 1e6:.0f} | {t_kernel * 1e6:.0f} | {packed} | {i8} "
                  f"| {t_deq * 1e6:.0f} | {weights[0].numel() * 4 / t_torch / 1e9:.1f} "
                  f"| {blocks[0].numel() / t_kernel / 1e9:.1f} | {t_torch / t_kernel:.2f}x | {speedup} | {i8_speedup} |",
                  flush=True)


if __name__ == "__main__":
    main()
