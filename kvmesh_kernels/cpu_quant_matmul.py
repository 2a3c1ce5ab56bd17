"""`y = x @ W^T` on the CPU with W kept in a GGUF file's blocks (kvmesh_kernels/cpu/quant_matmul.c): the
weights stay as the file holds them (Q4_K: 0.5625 bytes a weight, Q4_1: 0.625, Q5_K: 0.6875,
Q6_K: 0.82, Q8_0: 1.06, F16: 2, against float32's 4) and are dequantized exactly, a panel at a
time, next to a float32 matmul. The K-quants hold 256 weights a super-block: their rows are
multiples of 256 (`block_weights`).

  matmul      the native tiles: each weight read and dequantized once per call (decode, small M)
  dequantize  the whole weight to float32 (for a large M, where torch's GEMM over it is faster)
  linear      either, by the number of rows (`GEMM_ROWS`, per build), plus an optional bias
  linear_f16  F.linear of a `--dtype float16` model's layers: its float16 weights are F16 blocks
  pack        Q4_1 blocks repacked for the kernel (a vector's lanes are 16 output rows); the
              `*_packed` functions and `linear(..., n=rows)` compute with them: the layers' path
              where `packs_faster` measures it faster on the CPU at hand

The activations of a file's blocks are float32 and stay so (llama.cpp's own Q4_1 path quantizes them
to 8 bits): the result is a float32 matmul over the dequantized weights up to the order of the
sum. A block type is named by its GGML id (`QuantType`), as in the file. The exceptions are the
copies `--dtype auto` keeps of a layer's weights for its larger steps (never a file's blocks):

  BF16     on a CPU with AVX512_BF16 its tiles round x to bfloat16 and take the bfloat16 dot-product
           instruction, twice the float32 FMA's work per instruction; from `gemm_rows` its weight
           goes to torch's bfloat16 GEMM as it is
  Q4_1_I8  elsewhere (AVX2): the Q4_1 weights exactly, in groups of 8 rows, against x quantized to
           int8 per 32-block as llama.cpp quantizes activations (`to_i8_blocks`): integer dot
           products, 1.3-2x the float32 tiles' speed from one row to prefill sizes; Q4_K weights too
           (a sub-block of 32 is a Q4_1 block with float32 scales)
  Q8_0_I8  the same for Q8_0 weights (signed: vpsignb gives each product its sign)
  Q6_K_I8  the same for Q6_K weights, a scale for each half of a block
"""

from __future__ import annotations

import ctypes
import functools
import math
import time
from collections.abc import Sequence
from enum import IntEnum
from pathlib import Path

import torch
import torch.nn.functional as F

from kvmesh_kernels import native
from kvmesh_kernels.native import FAST_MATH

BLOCK = 32  # weights per block of every type but the K-quants; a row's length must be a multiple
K_BLOCK = 256  # weights per K-quant super-block (Q4_K, Q5_K, Q6_K)
_BASE_FLAGS = ("-O3", *FAST_MATH, "-fopenmp")
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_NAME = "quant_matmul"
# Vector bits of the build -> from how many rows of x up dequantizing the weight and calling torch's
# float32 GEMM is as fast as the tiles (docs/benchmarks/log.md, "Quantized weights"): AVX-512 tiles keep
# up with torch's GEMM to ~512 rows, AVX2 ones to ~64; the portable C ones never do.
GEMM_ROWS = {512: 256, 256: 64, 0: 1}
# Below this many multiply-adds (or weights dequantized) a call stays on one thread: waking a second
# OpenMP thread costs more than it saves. A decode step streams its weights from memory, at about one
# core's bandwidth a thread, so two threads pay from a few hundred thousand multiply-adds up: one
# sequence's decode step took 18.1 ms with every layer on one thread (the bound at 1 << 22, chosen on
# a machine crowded with other jobs) and 15.2 ms on two, on a quiet 2-core Xeon (docs/benchmarks/log.md).
PARALLEL_WORK = 1 << 18


class QuantType(IntEnum):
    """The GGUF block types the kernel reads (their GGML type ids)."""

    F16 = 1
    Q4_1 = 3
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30  # `--dtype auto`'s copies only (above): a file's BF16 tensors are dequantized at load
    Q4_1_I8 = 1003  # not GGML's: `--dtype auto`'s copies where there is no BF16 dot product (`to_i8_blocks`)
    Q8_0_I8 = 1004  # the same for Q8_0 weights (the LM head's)
    Q6_K_I8 = 1005  # the same for Q6_K weights: blocks of 32 with a scale per half


# Bytes of a block (a K-quant's: of a super-block).
BLOCK_BYTES = {QuantType.F16: 64, QuantType.Q4_1: 20, QuantType.Q8_0: 34, QuantType.Q4_K: 144, QuantType.Q5_K: 176,
               QuantType.Q6_K: 210, QuantType.BF16: 64, QuantType.Q4_1_I8: 24, QuantType.Q8_0_I8: 36,
               QuantType.Q6_K_I8: 40}
K_TYPES = (QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K)
# The blocks kept as a GGUF file holds them; a file's other types are dequantized at load.
FILE_TYPES = (QuantType.F16, QuantType.Q4_1, QuantType.Q8_0, *K_TYPES)


def block_weights(qtype: QuantType) -> int:
    """Weights per block of `qtype` (a K-quant's super-block): a row's length is a multiple."""
    return K_BLOCK if qtype in K_TYPES else BLOCK


def row_bytes(qtype: QuantType, k: int) -> int:
    """Bytes of one row of `k` weights (a multiple of `block_weights`) in `qtype`'s blocks."""
    size = block_weights(qtype)
    if k % size:
        raise ValueError(f"a row of {k} weights is not a whole number of {size}-weight {qtype.name} blocks")
    return k // size * BLOCK_BYTES[qtype]


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    signatures = {
        "quant_matmul": (None, [_P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, _INT, _INT]),
        "quant_dequantize": (None, [_P, _P, _I64, _I64, _I64, _INT, _INT]),
        "quant_block_bytes": (_I64, [_INT]),
        "quant_matmul_isa": (_INT, []),
        "quant_matmul_bf16_dot": (_INT, []),
        "quant_matmul_i8_path": (_INT, []),
        "quant_pack_i8": (None, [_P, _P, _I64, _I64, _I64, _INT]),
        "quant_packed_bytes": (_I64, [_I64, _I64]),
        "quant_pack_q4_1": (None, [_P, _P, _I64, _I64, _I64]),
        "quant_matmul_packed": (None, [_P, _I64, _P, _I64, _P, _I64, _I64, _I64, _INT]),
        "quant_dequantize_packed": (None, [_P, _P, _I64, _I64, _INT]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    for qtype, size in BLOCK_BYTES.items():
        assert lib.quant_block_bytes(qtype) == size, f"{qtype.name} blocks disagree with quant_matmul.c"
    return lib


# The served build (`build(cache_dir)`) and the other instruction sets' (`variant(isa, cache_dir)`).
_KERNEL = native.Kernel(_NAME, _BASE_FLAGS, _declare)
build, variant, available, compile_ahead = _KERNEL.build, _KERNEL.variant, _KERNEL.available, _KERNEL.compile_ahead


def is_built() -> bool:
    return native.is_built(_NAME)


def isa(lib: ctypes.CDLL | None = None) -> int:
    """The vector width in bits the build runs (512, 256), 0 for the portable C path."""
    return (lib or native.library(_NAME)).quant_matmul_isa()


def bf16_dot(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the build's BF16 tiles round x to bfloat16 for the dot-product instruction
    (AVX512_BF16); without it they widen the weights to float32 instead."""
    return bool((lib or native.library(_NAME)).quant_matmul_bf16_dot())


@functools.cache
def gemm_rows(lib: ctypes.CDLL | None = None) -> int:
    """The rows of x from which `linear` dequantizes and calls torch's GEMM, for this build."""
    return GEMM_ROWS[isa(lib)]


def _check_weight(blocks: torch.Tensor, qtype: QuantType, k: int) -> None:
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous() or blocks.device.type != "cpu":
        raise ValueError("the weight's blocks must be a contiguous [rows, row_bytes] uint8 CPU tensor")
    if blocks.shape[1] != row_bytes(qtype, k):
        raise ValueError(f"{blocks.shape[1]} bytes a row do not hold {k} weights in {qtype.name} blocks")


def _threads(work: int) -> int:
    return torch.get_num_threads() if work >= PARALLEL_WORK else 1


def matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: QuantType, k: int,
           lib: ctypes.CDLL | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, k] float32 with unit-stride rows; blocks: [N, row_bytes] -> [M, N] float32, new or `out`."""
    _check_weight(blocks, qtype, k)
    _check_x(x, k)
    m, n = x.shape[0], blocks.shape[0]
    y = _output(m, n, out)
    if m and n:
        (lib or native.library(_NAME)).quant_matmul(
            y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), blocks.data_ptr(), blocks.shape[1], m, n, k, qtype,
            _threads(m * n * k))
    return y


def to_bf16_blocks(weight: torch.Tensor) -> torch.Tensor:
    """A float [N, k] weight rounded to bfloat16 as BF16 blocks: [N, 2k] uint8."""
    return weight.to(torch.bfloat16).contiguous().view(torch.uint8)


# I8 weights come in groups of this many rows (quant_matmul.c, "int8 activations").
I8_GROUP_ROWS = 8
# The file's block types that have an int8-activation copy, and its type (a Q4_K sub-block of 32 is a
# Q4_1 block with float32 scales).
I8_OF = {QuantType.Q4_1: QuantType.Q4_1_I8, QuantType.Q4_K: QuantType.Q4_1_I8, QuantType.Q8_0: QuantType.Q8_0_I8,
         QuantType.Q6_K: QuantType.Q6_K_I8}
I8_TYPES = tuple(dict.fromkeys(I8_OF.values()))


def to_i8_blocks(blocks: torch.Tensor, qtype: QuantType, k: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """[N, row_bytes] Q4_1, Q4_K, Q8_0 or Q6_K blocks (N a multiple of I8_GROUP_ROWS) -> the same weights
    as Q4_1_I8 / Q8_0_I8 / Q6_K_I8 blocks (`I8_OF`), [N, k / 32 * 24 (36, 40)] uint8: rows in groups of 8
    laid out for integer dot products with int8 x."""
    if qtype not in I8_OF:
        raise ValueError(f"{qtype.name} blocks have no int8 copy; only {', '.join(t.name for t in I8_OF)}")
    _check_weight(blocks, qtype, k)
    if blocks.shape[0] % I8_GROUP_ROWS:
        raise ValueError(f"I8 weights hold their rows in groups of {I8_GROUP_ROWS}, not {blocks.shape[0]} rows")
    out = torch.empty(blocks.shape[0], row_bytes(I8_OF[qtype], k), dtype=torch.uint8)
    (lib or native.library(_NAME)).quant_pack_i8(out.data_ptr(), blocks.data_ptr(), blocks.shape[1],
                                                 blocks.shape[0], k, qtype)
    return out


def i8_path(lib: ctypes.CDLL | None = None) -> str:
    """How the build sums I8 products: "vnni-512" (vpdpbusd on 512-bit vectors, 16 rows at a time),
    "vnni" (on 256-bit ones), "avx2" (vpmaddubsw) or "c"."""
    return {3: "vnni-512", 1: "vnni", 2: "avx2", 0: "c"}[(lib or native.library(_NAME)).quant_matmul_i8_path()]


def dequantize(blocks: torch.Tensor, qtype: QuantType, k: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """blocks: [N, row_bytes] -> a new [N, k] float32 tensor, bit for bit gguf's `dequantize`."""
    _check_weight(blocks, qtype, k)
    out = torch.empty(blocks.shape[0], k, dtype=torch.float32)
    if blocks.shape[0]:
        (lib or native.library(_NAME)).quant_dequantize(out.data_ptr(), blocks.data_ptr(), blocks.shape[1],
                                                        blocks.shape[0], k, qtype, _threads(out.numel()))
    return out


def _check_x(x: torch.Tensor, k: int) -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x must be [M, {k}] float32 with unit-stride rows, got {x.dtype} {tuple(x.shape)}")


def _output(m: int, n: int, out: torch.Tensor | None) -> torch.Tensor:
    """`out`, checked to take an [m, n] float32 result (rows may lie apart), or a new tensor. A caller
    passes one it keeps to spare a large result fresh pages every call: an LM head's logits at 32 rows
    of a 262k vocabulary are 34 MB, which glibc maps anew each time (above its 32 MB mmap threshold),
    and faulting those pages in cost more than a tenth of a decode step."""
    if out is None:
        return torch.empty(m, n, dtype=torch.float32)
    if out.dtype != torch.float32 or out.shape != (m, n) or out.device.type != "cpu" or (n > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be [{m}, {n}] float32 with unit-stride rows, got {out.dtype} {tuple(out.shape)}")
    return out


# ------------------------------------------------------------------ packed Q4_1 (the layers' weights)

PACKABLE = (QuantType.Q4_1,)


# packs_faster's probe: a synthetic Q4_1 weight of the default model's gate / up shape (553 KB either
# way), timed at these rows of x on one thread, the best of REPEATS calls a path, each call on its
# own copy of the weight. The copies of both paths span 1.5 times the L3 (32 MB where unknown), at
# least 48 MB and at most 192, so that the first ones, which the calls read, are back in memory.
_PROBE_N, _PROBE_K, _PROBE_ROWS, _PROBE_REPEATS = 1536, 576, (1, 8), 5
_PROBE_SPAN_MIN, _PROBE_SPAN_MAX = 48 << 20, 192 << 20
# Packed wins at one row by at least this factor, and at eight by at least this one (level within noise).
_PROBE_GAIN_ONE_ROW, _PROBE_GAIN_EIGHT_ROWS = 1.05, 0.97


def packs_faster(lib: ctypes.CDLL | None = None) -> bool:
    """Whether layers should pack their Q4_1 weights (`pack`, `matmul_packed`) on this CPU with this
    build, decided by measurement once per process and library (cached).

    The rule: the portable build never packs (`linear` leaves all its rows to torch's GEMM). A vector
    build times `matmul` against `matmul_packed` on a synthetic Q4_1 weight of the gate / up shape
    (1536x576) at 1 and 8 rows of x, on one thread, as a decode step reads a weight: from memory
    (each call reads its own copy of the weight, written before 1.5 L3's worth of others: about
    15 ms on the 2-core Zen 5), interleaved, the best of 5 calls each. It packs when the packed
    calls are at least 5 % faster at one row and not slower at eight (at least 0.97x, the noise).
    Where it was tuned, on a Sapphire Rapids Xeon, the AVX-512 build packed faster (1.3-1.9x at one
    to four rows); on a Zen 5 EPYC the row-order tiles (with their prefetching) are about twice as
    fast as the panels at 1 and 8 rows, so it does not pack; the AVX2 build loses at eight rows and
    more on both (docs/benchmarks/log.md, "Quantized matmul on the AMD EPYC Zen 5").

    Both paths compute the float32 matmul over the same exactly dequantized weights; they sum in
    different orders, so the choice can move logits by a rounding, never a weight."""
    return _packs_faster(lib or native.library(_NAME))


@functools.cache
def _packs_faster(lib: ctypes.CDLL) -> bool:
    if isa(lib) == 0:
        return False
    best_row, best_packed = _probe_packing(lib)
    gains = [row / packed for row, packed in zip(best_row, best_packed)]
    return gains[0] >= _PROBE_GAIN_ONE_ROW and gains[1] >= _PROBE_GAIN_EIGHT_ROWS


def _probe_packing(lib: ctypes.CDLL) -> tuple[list[int], list[int]]:
    """packs_faster's timings: per row count in _PROBE_ROWS, the best ns of a call of each path."""
    n, k = _PROBE_N, _PROBE_K
    width = row_bytes(QuantType.Q4_1, k)
    one = _probe_weight()
    packed_one = pack(one, QuantType.Q4_1, k, lib)
    copy_bytes = packed_one.numel()
    span = min(max(_l3_bytes() * 3 // 2, _PROBE_SPAN_MIN), _PROBE_SPAN_MAX)
    copies = max(span // (one.numel() + copy_bytes), 2 * len(_PROBE_ROWS) * _PROBE_REPEATS)
    rows = one.repeat(copies, 1)  # copy c: rows c * n ..
    packed = packed_one.repeat(copies)  # n is a multiple of 32: a copy is a slice of the packing
    best_row, best_packed = [], []
    call = 0
    for m in _PROBE_ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        y = torch.empty(m, n)
        times = {False: [], True: []}
        for _ in range(_PROBE_REPEATS):
            for is_packed in (False, True):
                c, call = call // 2, call + 1  # the copies written first
                start = time.perf_counter_ns()
                if is_packed:
                    lib.quant_matmul_packed(y.data_ptr(), n, x.data_ptr(), k, packed.data_ptr() + c * copy_bytes,
                                            m, n, k, 1)
                else:
                    lib.quant_matmul(y.data_ptr(), n, x.data_ptr(), k, rows.data_ptr() + c * n * width, width,
                                     m, n, k, QuantType.Q4_1, 1)
                times[is_packed].append(time.perf_counter_ns() - start)
        best_row.append(min(times[False]))
        best_packed.append(min(times[True]))
    return best_row, best_packed


# fastest_copy's probe: the same synthetic Q4_1 weight, warm in the cache (at these rows the tiles are
# bound by arithmetic), on every thread, at the rows of a batch of decodes and of a prefill chunk.
_COPY_PROBE_ROWS = (32, 256)
# A copy must win by this factor: below it, the exact float32 tiles are the default's path.
_COPY_PROBE_GAIN = 1.05
COPY_TYPES = (QuantType.BF16, QuantType.Q4_1_I8)


def fastest_copy(copy_types: Sequence[QuantType], lib: ctypes.CDLL | None = None) -> QuantType | None:
    """Of `--dtype auto`'s proposed copies (BF16, Q4_1_I8 standing for the I8 types), the one that
    multiplies fastest on this CPU with this build, or None where none is at least 5 % faster than the
    exact float32 tiles over the file's blocks; decided by measurement once per process and library
    (cached), as `packs_faster`. A copy's score is the geometric mean of its speed-ups over the exact
    tiles at 32 rows (a batch of decodes) and at 256 (a prefill chunk, where the BF16 copy hands off to
    torch's bfloat16 GEMM). The instructions a CPU has do not settle it: a 256-bit datapath (Zen 4)
    runs AVX-512 and its bfloat16 dot products at half width, where VNNI's integer dot products were
    measured faster than both."""
    return _fastest_copy(tuple(copy_types), lib or native.library(_NAME))


@functools.cache
def _fastest_copy(copy_types: tuple[QuantType, ...], lib: ctypes.CDLL) -> QuantType | None:
    if not copy_types:
        return None
    exact, copies = _probe_copies(copy_types, lib)
    speedups = {qtype: math.prod(e / c for e, c in zip(exact, times)) ** (1 / len(exact))
                for qtype, times in copies.items()}
    best = max(copy_types, key=speedups.__getitem__)  # the first proposed where they tie
    return best if speedups[best] >= _COPY_PROBE_GAIN else None


def _probe_copies(copy_types: Sequence[QuantType], lib: ctypes.CDLL) -> tuple[list[int], dict[QuantType, list[int]]]:
    """fastest_copy's timings: per row count in _COPY_PROBE_ROWS, the best ns of a call of the exact
    tiles, and of each copy's (through `linear`, as a layer calls it), interleaved."""
    if not copy_types or any(qtype not in COPY_TYPES for qtype in copy_types):
        raise ValueError(f"the copies are BF16 or Q4_1_I8 (the I8 types'), not {[t.name for t in copy_types]}")
    n, k = _PROBE_N, _PROBE_K
    exact = _probe_weight()
    weights = {QuantType.Q4_1: exact}
    for qtype in copy_types:
        weights[qtype] = (to_bf16_blocks(dequantize(exact, QuantType.Q4_1, k, lib)) if qtype == QuantType.BF16
                          else to_i8_blocks(exact, QuantType.Q4_1, k, lib))
    best = {qtype: [] for qtype in weights}
    for m in _COPY_PROBE_ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        y = torch.empty(m, n)
        times = {qtype: float("inf") for qtype in weights}
        for _ in range(_PROBE_REPEATS + 1):  # the first round warms the caches and the threads
            for qtype, weight in weights.items():
                start = time.perf_counter_ns()
                linear(x, weight, qtype, k, lib=lib, out=y)
                times[qtype] = min(times[qtype], time.perf_counter_ns() - start)
        for qtype, ns in times.items():
            best[qtype].append(int(ns))
    return best.pop(QuantType.Q4_1), best


def _probe_weight() -> torch.Tensor:
    """The probes' synthetic [_PROBE_N, _PROBE_K] Q4_1 weight: one block of every nibble value, repeated."""
    block = torch.arange(20, dtype=torch.int64).mul(37).remainder(256).to(torch.uint8)  # nibbles of all values
    block[:4] = torch.tensor([0x66, 0x2E, 0x66, 0xAE], dtype=torch.uint8)  # d = 0.1, m = -0.1 (f16): no subnormals
    return block.repeat(_PROBE_N * (_PROBE_K // BLOCK)).reshape(_PROBE_N, row_bytes(QuantType.Q4_1, _PROBE_K))


def _l3_bytes() -> int:
    """The L3 cache's size from sysfs (Linux), else 32 MB."""
    try:
        for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
            if (index / "level").read_text().strip() == "3":
                size = (index / "size").read_text().strip()
                return int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20}[size[-1]] if size[-1] in "KM" else int(size)
    except (OSError, ValueError):
        pass
    return 32 << 20


def pack(blocks: torch.Tensor, qtype: QuantType, k: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """[N, row_bytes] Q4_1 blocks -> the same weights in the kernel's panel layout (quant_matmul.c,
    "packed Q4_1"): a 1-D uint8 tensor of about the same size (rows padded to a multiple of 32)."""
    if qtype not in PACKABLE:
        raise ValueError(f"{qtype.name} blocks are not packed; only {', '.join(t.name for t in PACKABLE)}")
    _check_weight(blocks, qtype, k)
    lib = lib or native.library(_NAME)
    out = torch.empty(lib.quant_packed_bytes(blocks.shape[0], k), dtype=torch.uint8)
    lib.quant_pack_q4_1(out.data_ptr(), blocks.data_ptr(), blocks.shape[1], blocks.shape[0], k)
    return out


def unpack(packed: torch.Tensor, n: int, k: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """`pack`'s [n, k] weight -> its Q4_1 blocks in row order again ([n, row_bytes] uint8)."""
    _check_packed(packed, n, k, lib or native.library(_NAME))
    panels = packed.reshape(-1, k // BLOCK, 320)  # [panel, block, bytes]: 16 d | 16 m | qs[j] of the 16 rows
    rows = torch.cat([panels[..., :32].reshape(-1, k // BLOCK, 16, 2), panels[..., 32:64].reshape(-1, k // BLOCK, 16, 2),
                      panels[..., 64:].reshape(-1, k // BLOCK, 16, 16).transpose(2, 3)], dim=-1)
    return rows.transpose(1, 2).reshape(-1, row_bytes(QuantType.Q4_1, k))[:n].contiguous()


@functools.cache
def _packed_bytes(n: int, k: int, lib: ctypes.CDLL) -> int:
    """quant_packed_bytes, asked once per shape: the check runs on every layer's call of a step."""
    return lib.quant_packed_bytes(n, k)


def _check_packed(packed: torch.Tensor, n: int, k: int, lib: ctypes.CDLL) -> None:
    if k % BLOCK:
        raise ValueError(f"a row of {k} weights is not a whole number of {BLOCK}-weight blocks")
    if packed.dtype != torch.uint8 or packed.dim() != 1 or not packed.is_contiguous() or packed.device.type != "cpu" \
            or packed.numel() != _packed_bytes(n, k, lib):
        raise ValueError(f"not a packed [{n}, {k}] weight: {packed.dtype} {tuple(packed.shape)}")


def matmul_packed(x: torch.Tensor, packed: torch.Tensor, n: int, k: int, lib: ctypes.CDLL | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, k] float32 with unit-stride rows; packed: `pack`'s [n, k] weight -> [M, n] float32, new or `out`."""
    lib = lib or native.library(_NAME)
    _check_packed(packed, n, k, lib)
    _check_x(x, k)
    m = x.shape[0]
    y = _output(m, n, out)
    if m and n:
        lib.quant_matmul_packed(y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), packed.data_ptr(), m, n, k,
                                _threads(m * n * k))
    return y


def dequantize_packed(packed: torch.Tensor, n: int, k: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """`pack`'s [n, k] weight -> a new [n, k] float32 tensor, bit for bit `dequantize` of its blocks."""
    lib = lib or native.library(_NAME)
    _check_packed(packed, n, k, lib)
    out = torch.empty(n, k, dtype=torch.float32)
    if n:
        lib.quant_dequantize_packed(out.data_ptr(), packed.data_ptr(), n, k, _threads(out.numel()))
    return out


def linear(x: torch.Tensor, blocks: torch.Tensor, qtype: QuantType, k: int, bias: torch.Tensor | None = None,
           lib: ctypes.CDLL | None = None, n: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, W, bias) for W in blocks: x [..., k] float32 -> [..., N] float32. With `n`, `blocks`
    is `pack`'s [n, k] weight. From `gemm_rows` rows up the dequantized weight goes to torch's GEMM
    (BF16: the weight as it is, with x rounded to bfloat16), except an I8 one, whose tiles are
    faster at every row count. `out` ([rows of x, N], x 2-D): where the result goes (see `_output`)."""
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    packed = n is not None
    n = n if packed else blocks.shape[0]
    if rows.shape[0] >= gemm_rows(lib) and qtype not in I8_TYPES:  # their integer sums beat the GEMM
        if qtype == QuantType.BF16:
            _check_weight(blocks, qtype, k)
            y = F.linear(rows.to(torch.bfloat16), blocks.view(torch.bfloat16)).float()
            if bias is not None:
                y += bias
        else:
            weight = dequantize_packed(blocks, n, k, lib) if packed else dequantize(blocks, qtype, k, lib)
            y = F.linear(rows, weight, bias)
        if out is not None:  # the GEMM's own result is no larger than the weight it dequantized
            y = _output(rows.shape[0], n, out).copy_(y)
    else:
        y = matmul_packed(rows, blocks, n, k, lib, out) if packed else matmul(rows, blocks, qtype, k, lib, out)
        if bias is not None:
            y += bias
    return y.reshape(*x.shape[:-1], n)


def linear_f16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) all in float16, as torch computes it on a CPU (float32 sums rounded to
    float16 once), at the speed of float32 arithmetic: a [N, k] float16 weight's bytes are F16 blocks, so
    the tiles widen it (F16C, AVX-512F) into float32 FMAs against x widened to float32, and from
    `gemm_rows` torch's float32 GEMM takes it widened whole. torch's own float16 GEMM took 2-7x this
    time at 1-64 rows on an AVX2 EPYC (docs/benchmarks/log.md). x: [..., k] float16 -> [..., N] float16."""
    if x.dtype != torch.float16 or weight.dtype != torch.float16 or weight.dim() != 2:
        raise ValueError(f"linear_f16 takes float16 x and a [N, k] float16 weight, got {x.dtype} and "
                         f"{weight.dtype} {tuple(weight.shape)}")
    y = linear(x.float(), weight.view(torch.uint8), QuantType.F16, weight.shape[1],
               None if bias is None else bias.float(), lib)
    return y.to(torch.float16)
