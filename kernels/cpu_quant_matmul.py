"""`y = x @ W^T` on the CPU with W kept in a GGUF file's blocks (kernels/cpu/quant_matmul.c): the
weights stay as the file holds them (Q4_1: 0.625 bytes a weight, Q8_0: 1.06, F16: 2, against
float32's 4) and are dequantized exactly, a panel at a time, next to a float32 matmul.

  matmul      the native tiles: each weight read and dequantized once per call (decode, small M)
  dequantize  the whole weight to float32 (for a large M, where torch's GEMM over it is faster)
  linear      either, by the number of rows (`GEMM_ROWS`, per build), plus an optional bias
  pack        Q4_1 blocks repacked for the kernel (a vector's lanes are 16 output rows); the
              `*_packed` functions and `linear(..., n=rows)` compute with them: the layers' path on
              the AVX-512 build (`packs_faster`)

The activations are float32 and stay so (llama.cpp's own Q4_1 path quantizes them to 8 bits; this
one does not): the result is a float32 matmul over the dequantized weights up to the order of the
sum. A block type is named by its GGML id (`QuantType`), as in the file.
"""

from __future__ import annotations

import ctypes
import functools
from enum import IntEnum

import torch
import torch.nn.functional as F

from kernels import native
from kernels.native import FAST_MATH

BLOCK = 32  # weights per block of every type here; a row's length must be a multiple
_BASE_FLAGS = ("-O3", *FAST_MATH, "-fopenmp")
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_NAME = "quant_matmul"
# Vector bits of the build -> from how many rows of x up dequantizing the weight and calling torch's
# float32 GEMM is as fast as the tiles (docs/benchmarks.md, "Quantized weights"): AVX-512 tiles keep
# up with torch's GEMM to ~512 rows, AVX2 ones to ~64; the portable C ones never do.
GEMM_ROWS = {512: 256, 256: 64, 0: 1}
# Below this many multiply-adds (or weights dequantized) a call stays on one thread: waking a second
# OpenMP thread costs more than it saves. A decode step streams its weights from memory, at about one
# core's bandwidth a thread, so two threads pay from a few hundred thousand multiply-adds up: one
# sequence's decode step took 18.1 ms with every layer on one thread (the bound at 1 << 22, chosen on
# a machine crowded with other jobs) and 15.2 ms on two, on a quiet 2-core Xeon (docs/benchmarks.md).
PARALLEL_WORK = 1 << 18


class QuantType(IntEnum):
    """The GGUF block types the kernel reads (their GGML type ids)."""

    F16 = 1
    Q4_1 = 3
    Q8_0 = 8


BLOCK_BYTES = {QuantType.F16: 64, QuantType.Q4_1: 20, QuantType.Q8_0: 34}


def row_bytes(qtype: QuantType, k: int) -> int:
    """Bytes of one row of `k` weights (a multiple of BLOCK) in `qtype`'s blocks."""
    if k % BLOCK:
        raise ValueError(f"a row of {k} weights is not a whole number of {BLOCK}-weight blocks")
    return k // BLOCK * BLOCK_BYTES[qtype]


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    signatures = {
        "quant_matmul": (None, [_P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, _INT, _INT]),
        "quant_dequantize": (None, [_P, _P, _I64, _I64, _I64, _INT, _INT]),
        "quant_block_bytes": (_I64, [_INT]),
        "quant_matmul_isa": (_INT, []),
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
build, variant = _KERNEL.build, _KERNEL.variant


def is_built() -> bool:
    return native.is_built(_NAME)


def isa(lib: ctypes.CDLL | None = None) -> int:
    """The vector width in bits the build runs (512, 256), 0 for the portable C path."""
    return (lib or native.library(_NAME)).quant_matmul_isa()


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
           lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x: [M, k] float32 with unit-stride rows; blocks: [N, row_bytes] -> a new [M, N] float32."""
    _check_weight(blocks, qtype, k)
    _check_x(x, k)
    m, n = x.shape[0], blocks.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m and n:
        (lib or native.library(_NAME)).quant_matmul(
            y.data_ptr(), n, x.data_ptr(), x.stride(0), blocks.data_ptr(), blocks.shape[1], m, n, k, qtype,
            _threads(m * n * k))
    return y


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


# ------------------------------------------------------------------ packed Q4_1 (the layers' weights)

PACKABLE = (QuantType.Q4_1,)


def packs_faster(lib: ctypes.CDLL | None = None) -> bool:
    """Whether layers should pack their Q4_1 weights for this build: the AVX-512 one (1.3-2.2x faster
    calls at one to four rows, level from eight). The AVX2 build gains at one to four rows but loses 25-33 % at 32
    (eight lanes leave its buffered tiles short of registers), and the portable one never multiplies
    in tiles (docs/benchmarks.md, "llama-server side by side"), so they keep the file's row order."""
    return isa(lib) == 512


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


def matmul_packed(x: torch.Tensor, packed: torch.Tensor, n: int, k: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x: [M, k] float32 with unit-stride rows; packed: `pack`'s [n, k] weight -> a new [M, n] float32."""
    lib = lib or native.library(_NAME)
    _check_packed(packed, n, k, lib)
    _check_x(x, k)
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m and n:
        lib.quant_matmul_packed(y.data_ptr(), n, x.data_ptr(), x.stride(0), packed.data_ptr(), m, n, k,
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
           lib: ctypes.CDLL | None = None, n: int | None = None) -> torch.Tensor:
    """F.linear(x, W, bias) for W in blocks: x [..., k] float32 -> [..., N] float32. With `n`, `blocks`
    is `pack`'s [n, k] weight."""
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    packed = n is not None
    n = n if packed else blocks.shape[0]
    if rows.shape[0] >= gemm_rows(lib):
        weight = dequantize_packed(blocks, n, k, lib) if packed else dequantize(blocks, qtype, k, lib)
        y = F.linear(rows, weight, bias)
    else:
        y = matmul_packed(rows, blocks, n, k, lib) if packed else matmul(rows, blocks, qtype, k, lib)
        if bias is not None:
            y += bias
    return y.reshape(*x.shape[:-1], n)
