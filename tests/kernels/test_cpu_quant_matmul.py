"""The quantized-weight matmul (kvmesh_kernels/cpu_quant_matmul.py) in every build this CPU runs (native,
AVX2 built explicitly, portable C, AVX-512 emulated where the CPU lacks it): its dequantization bit
for bit gguf's (what transformers converts a GGUF file with), its matmul a float32 matmul over those
weights up to the sum's order, over odd shapes, both of `linear`'s paths and every block type it
reads."""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvmesh_kernels import cpu_quant_matmul as qm
from kvmesh_kernels import native
from kvmesh_kernels.cpu_quant_matmul import QuantType
from services.common.config import default_cache_dir
from tests.kernels.avx512_emulation import EMULATED


# The types whose rows are blocks of their own and that gguf quantizes (the I8 copies hold their rows in
# groups: their own tests below; the K-quants: tests/kernels/test_cpu_kquant_matmul.py).
ROW_TYPES = [qtype for qtype in QuantType if qtype not in qm.I8_TYPES and qtype not in qm.K_TYPES]
# The builds with tiles of their own; the portable one leaves its tiles to the compiler's vectorizer
# and its linear to torch, and is never probed for packing (its own tests say so).
VECTOR_BUILDS = [isa for isa in native.ISA_FLAGS if isa != "scalar"]


@pytest.fixture
def lib(isa: str) -> ctypes.CDLL:
    return qm.variant(isa, default_cache_dir())


def quantized(rows: int, cols: int, qtype: QuantType, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random [rows, cols] weights in `qtype` blocks (gguf's own quantizer) and gguf's dequantization."""
    values = np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32)
    values[:, :32] *= 1e-6  # small blocks: scales and minimums far apart in exponent
    data = gguf.quants.quantize(values, gguf.GGMLQuantizationType(qtype)).view(np.uint8).reshape(rows, -1)
    reference = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(qtype)).reshape(rows, cols)
    return torch.from_numpy(data.copy()), torch.from_numpy(np.ascontiguousarray(reference, dtype=np.float32))


def test_the_build_runs_the_path_it_was_built_for(isa, lib):
    want = {"avx2": 256, "scalar": 0, EMULATED: 512}.get(isa)
    if want is None:
        want = 512 if native.cpu_has("avx512f") else 256
    assert qm.isa(lib) == want


@pytest.mark.parametrize("qtype", ROW_TYPES)
def test_dequantize_is_gguf_bit_for_bit(lib, qtype):
    blocks, reference = quantized(13, 96, qtype, seed=int(qtype))
    assert torch.equal(qm.dequantize(blocks, qtype, 96, lib), reference)


@pytest.mark.parametrize("qtype", ROW_TYPES)
@pytest.mark.parametrize("m, n, k", [(1, 1, 32), (1, 37, 96), (2, 5, 64), (3, 17, 576), (4, 8, 32), (5, 3, 160),
                                     (9, 4, 96), (33, 19, 64), (70, 6, 32)])
def test_matmul_is_a_float32_matmul_over_the_dequantized_weights(lib, qtype, m, n, k):
    blocks, weight = quantized(n, k, qtype, seed=m * n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    # BF16 blocks meet x rounded to bfloat16 where the build takes the dot-product instruction
    rounded = x.bfloat16().float() if qtype == QuantType.BF16 and qm.bf16_dot(lib) else x
    want = (rounded.double() @ weight.double().T).float()
    got = qm.matmul(x, blocks, qtype, k, lib)
    assert got.shape == (m, n)
    # float32 sums of k products in another order than float64's: well under 1e-5 relative here.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k**0.5)


@pytest.mark.parametrize("isa", VECTOR_BUILDS, indirect=True)
@pytest.mark.parametrize("qtype", ROW_TYPES)
@pytest.mark.parametrize("m", [2, 4, 5, 11])
def test_a_row_sums_alike_whatever_the_batch(lib, qtype, m):
    # Up to MR rows of x multiply the blocks in registers, more a panel's dequantized buffer: the same
    # sum order (and the same horizontal sums) either way, so a request's logits (the LM head's Q8_0)
    # do not depend on the requests beside it.
    blocks, _ = quantized(23, 96, qtype, seed=m)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
    batch = qm.matmul(x, blocks, qtype, 96, lib)
    for i in range(m):
        assert torch.equal(qm.matmul(x[i : i + 1], blocks, qtype, 96, lib)[0], batch[i])


def test_bf16_dot_products_where_the_cpu_has_them(isa, lib):
    assert qm.bf16_dot(lib) == (isa == EMULATED or isa == "native" and native.cpu_has("avx512_bf16"))


def test_linear_takes_a_bf16_weight_to_torch_bfloat16_gemm_from_gemm_rows(lib):
    blocks, weight = quantized(24, 128, QuantType.BF16, seed=3)
    x, bias = torch.randn(qm.gemm_rows(lib), 128), torch.randn(24)
    got = qm.linear(x, blocks, QuantType.BF16, 128, bias, lib)
    assert torch.equal(got, F.linear(x.bfloat16(), weight.bfloat16()).float() + bias)


def test_matmul_reads_x_rows_at_their_stride(lib):
    blocks, weight = quantized(6, 64, QuantType.Q4_1, seed=1)
    wide = torch.randn(5, 100)
    x = wide[:, 10:74]  # rows 100 floats apart
    torch.testing.assert_close(qm.matmul(x, blocks, QuantType.Q4_1, 64, lib), x @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", [QuantType.Q8_0, QuantType.Q8_0_I8])
@pytest.mark.parametrize("rows", [1, 8, 300])
def test_a_result_goes_into_the_callers_buffer_rows_at_their_stride(lib, qtype, rows):
    """`out` (an LM head's logits kept across steps) takes exactly what a new result would hold, on
    each of linear's paths, and is the tensor returned."""
    blocks, _ = quantized(24, 128, QuantType.Q8_0, seed=rows)
    if qtype == QuantType.Q8_0_I8:
        blocks = qm.to_i8_blocks(blocks, QuantType.Q8_0, 128, lib)
    x = torch.randn(rows, 128)
    wide = torch.full((rows, 40), float("nan"))
    out = wide[:, 8:32]  # rows 40 floats apart; the columns around them stay untouched
    got = qm.linear(x, blocks, qtype, 128, lib=lib, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out, qm.linear(x, blocks, qtype, 128, lib=lib))
    assert wide[:, :8].isnan().all() and wide[:, 32:].isnan().all()
    with pytest.raises(ValueError, match="out must be"):
        qm.matmul(x, blocks, qtype, 128, lib, out=torch.empty(rows, 25))


@pytest.mark.parametrize("rows", [1, 3, 300])
def test_linear_either_path_equals_f_linear_with_bias(lib, rows):
    blocks, weight = quantized(24, 128, QuantType.Q8_0, seed=rows)
    x, bias = torch.randn(rows, 128), torch.randn(24)
    got = qm.linear(x.reshape(1, rows, 128), blocks, QuantType.Q8_0, 128, bias, lib)
    assert got.shape == (1, rows, 24)
    torch.testing.assert_close(got[0], F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 17, 64, 65, 300])
def test_linear_f16_is_torchs_float16_linear_within_its_rounding(lib, rows):
    # A `--dtype float16` layer: torch's float16 F.linear sums in float32 and rounds once, as linear_f16
    # does over the weight's bytes read as F16 blocks; only the sums' order differs (from gemm_rows the
    # widened weight goes to torch's float32 GEMM: 64 rows on AVX2, 256 on AVX-512, all on the portable build).
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).half()
    weight, bias = (torch.randn(40, 576, generator=gen) * 0.05).half(), torch.randn(40, generator=gen).half()
    got = qm.linear_f16(x.reshape(1, rows, 576), weight, bias, lib)
    assert got.shape == (1, rows, 40) and got.dtype == torch.float16
    want = F.linear(x, weight, bias)
    torch.testing.assert_close(got[0], want, rtol=2**-10, atol=2**-14)  # one float16 ulp at most
    assert (got[0] != want).float().mean() < 0.01
    with pytest.raises(ValueError, match="float16"):
        qm.linear_f16(x.float(), weight, bias, lib)


def test_the_portable_build_leaves_every_row_count_to_torch_gemm(lib):
    # Where the tiles are slower than dequantize + GEMM (docs/benchmarks/log.md), linear never takes them.
    assert qm.gemm_rows(lib) == {0: 1, 256: 64, 512: 256}[qm.isa(lib)]


def test_bad_inputs_are_refused_with_a_reason(lib):
    blocks, _ = quantized(4, 64, QuantType.Q4_1, seed=0)
    with pytest.raises(ValueError, match="not a whole number"):
        qm.row_bytes(QuantType.Q4_1, 48)
    with pytest.raises(ValueError, match="do not hold"):
        qm.matmul(torch.randn(1, 96), blocks, QuantType.Q4_1, 96, lib)
    with pytest.raises(ValueError, match="float32"):
        qm.matmul(torch.randn(1, 64, dtype=torch.float64), blocks, QuantType.Q4_1, 64, lib)
    with pytest.raises(ValueError, match="uint8"):
        qm.dequantize(blocks.view(torch.int8), QuantType.Q4_1, 64, lib)


# ------------------------------------------------------------------ `--dtype auto`'s copies, by measurement


def test_the_copy_probe_times_the_exact_tiles_and_each_copy_at_a_decode_batch_and_a_prefill_chunk(lib):
    # The answer depends on the CPU, so only the timings' form and the rule are checked (below)
    exact, copies = qm._probe_copies(qm.COPY_TYPES, lib)
    assert set(copies) == set(qm.COPY_TYPES)
    for times in (exact, *copies.values()):
        assert len(times) == len(qm._COPY_PROBE_ROWS) and all(isinstance(t, int) and t > 0 for t in times)
    with pytest.raises(ValueError, match="BF16 or Q4_1_I8"):
        qm._probe_copies((QuantType.Q8_0,), lib)


@pytest.mark.parametrize("bf16, i8, fastest", [
    ((500, 5000), (600, 6000), QuantType.BF16),  # 2x at both sizes against 1.67x
    ((500, 5000), (250, 9000), QuantType.Q4_1_I8),  # the geometric means: 2x against 2.24x
    ((950, 9500), (2000, 20000), QuantType.BF16),  # 1.05x is enough
    ((960, 9600), (2000, 20000), None),  # 1.04x is not: the exact tiles
    ((1000, 10000), (1000, 10000), None),
    ((500, 5000), (500, 5000), QuantType.BF16),  # a tie goes to the first proposed
])
def test_the_fastest_copy_is_taken_only_when_it_measures_5_percent_faster(monkeypatch, lib, bf16, i8, fastest):
    timings = [1000, 10000], {QuantType.BF16: list(bf16), QuantType.Q4_1_I8: list(i8)}
    monkeypatch.setattr(qm, "_probe_copies", lambda types, _lib: (timings[0], {t: timings[1][t] for t in types}))
    qm._fastest_copy.cache_clear()
    try:
        assert qm.fastest_copy(qm.COPY_TYPES, lib) == fastest
        assert qm.fastest_copy(qm.COPY_TYPES, lib) == fastest  # cached: measured once a process
        assert qm._fastest_copy.cache_info().hits == 1
        # Proposed alone (a CPU without bfloat16 instructions), the I8 copy against the exact tiles only
        assert qm.fastest_copy((QuantType.Q4_1_I8,), lib) == (QuantType.Q4_1_I8 if i8[0] < 1000 else None)
        assert qm.fastest_copy((), lib) is None
    finally:
        qm._fastest_copy.cache_clear()  # the next caller measures for real


# ------------------------------------------------------------------ packed Q4_1 (the layers' path)


def test_packs_faster_measures_once_per_library_and_answers_a_bool(lib):
    # The answer depends on the CPU (it times both paths), so only its form and its caching are
    # checked here; both paths are tested for their results below whatever it says.
    choice = qm.packs_faster(lib)
    assert isinstance(choice, bool)
    hits = qm._packs_faster.cache_info().hits
    assert qm.packs_faster(lib) is choice
    assert qm._packs_faster.cache_info().hits == hits + 1


@pytest.mark.parametrize("isa", ["scalar"], indirect=True)
def test_the_portable_build_is_never_probed_and_never_packs(monkeypatch, lib):
    # Its linear leaves every row count to torch's GEMM: there is nothing to time.
    monkeypatch.setattr(qm, "_probe_packing", lambda _lib: pytest.fail("the portable build was probed"))
    qm._packs_faster.cache_clear()
    try:
        assert qm.packs_faster(lib) is False
    finally:
        qm._packs_faster.cache_clear()


@pytest.mark.parametrize("isa", VECTOR_BUILDS, indirect=True)
def test_the_probe_times_both_paths_at_one_and_eight_rows(lib):
    best_row, best_packed = qm._probe_packing(lib)
    assert len(best_row) == len(best_packed) == len(qm._PROBE_ROWS) == 2
    assert all(isinstance(t, int) and t > 0 for t in best_row + best_packed)


@pytest.mark.parametrize("isa", VECTOR_BUILDS, indirect=True)
@pytest.mark.parametrize("timings, packs", [
    (([100, 800], [94, 800]), True),   # 6 % faster at one row, level at eight
    (([100, 800], [94, 820]), True),   # 2.4 % slower at eight: within the noise allowed
    (([100, 800], [97, 700]), False),  # 3 % faster at one row only
    (([100, 800], [60, 900]), False),  # far faster at one row, 11 % slower at eight
    (([100, 800], [130, 700]), False),
])
def test_packs_faster_packs_when_clearly_faster_at_one_row_and_not_slower_at_eight(monkeypatch, lib, timings, packs):
    monkeypatch.setattr(qm, "_probe_packing", lambda _lib: timings)
    qm._packs_faster.cache_clear()
    try:
        assert qm.packs_faster(lib) is packs
    finally:
        qm._packs_faster.cache_clear()  # the next caller measures for real


@pytest.mark.parametrize("n, k", [(1, 32), (17, 96), (32, 64), (45, 576), (100, 160)])
def test_packed_weights_dequantize_to_gguf_bit_for_bit(lib, n, k):
    blocks, reference = quantized(n, k, QuantType.Q4_1, seed=n + k)
    assert torch.equal(qm.dequantize_packed(qm.pack(blocks, QuantType.Q4_1, k, lib), n, k, lib), reference)


@pytest.mark.parametrize("m, n, k", [(1, 1, 32), (1, 37, 96), (2, 5, 64), (3, 17, 576), (4, 33, 32), (5, 3, 160),
                                     (9, 40, 96), (33, 19, 64), (70, 6, 32)])
def test_packed_matmul_is_a_float32_matmul_over_the_dequantized_weights(lib, m, n, k):
    blocks, weight = quantized(n, k, QuantType.Q4_1, seed=m * n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    got = qm.matmul_packed(x, qm.pack(blocks, QuantType.Q4_1, k, lib), n, k, lib)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, (x.double() @ weight.double().T).float(), rtol=1e-5, atol=1e-5 * k**0.5)


@pytest.mark.parametrize("m", [2, 4, 5, 11])
def test_a_packed_row_sums_alike_whatever_the_batch(lib, m):
    # Up to four rows dequantize in registers, more through a buffer: the same sum order either way,
    # so a request's logits do not depend on the requests beside it.
    blocks, _ = quantized(50, 96, QuantType.Q4_1, seed=m)
    packed = qm.pack(blocks, QuantType.Q4_1, 96, lib)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
    batch = qm.matmul_packed(x, packed, 50, 96, lib)
    for i in range(m):
        assert torch.equal(qm.matmul_packed(x[i : i + 1], packed, 50, 96, lib)[0], batch[i])


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_packed_linear_either_path_equals_f_linear_with_bias(lib, rows):
    blocks, weight = quantized(40, 128, QuantType.Q4_1, seed=rows)
    x, bias = torch.randn(rows, 128), torch.randn(40)
    packed = qm.pack(blocks, QuantType.Q4_1, 128, lib)
    got = qm.linear(x.reshape(1, rows, 128), packed, QuantType.Q4_1, 128, bias, lib, n=40)
    assert got.shape == (1, rows, 40)
    torch.testing.assert_close(got[0], F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_a_packed_weight_unpacks_to_its_blocks(lib):
    blocks, _ = quantized(45, 96, QuantType.Q4_1, seed=7)
    assert torch.equal(qm.unpack(qm.pack(blocks, QuantType.Q4_1, 96, lib), 45, 96, lib), blocks)


def test_only_q4_1_is_packed_and_a_packed_weight_must_fit_its_shape(lib):
    blocks, _ = quantized(8, 64, QuantType.Q8_0, seed=0)
    with pytest.raises(ValueError, match="Q8_0 blocks are not packed"):
        qm.pack(blocks, QuantType.Q8_0, 64, lib)
    packed = qm.pack(quantized(8, 64, QuantType.Q4_1, seed=0)[0], QuantType.Q4_1, 64, lib)
    with pytest.raises(ValueError, match="not a packed"):
        qm.matmul_packed(torch.randn(1, 64), packed, 40, 64, lib)  # 40 rows pad to 64: more bytes than 8's


# ------------------------------------------------------------------ Q4_1_I8 / Q8_0_I8 (int8 x, `--dtype auto` on AVX2)

I8_FILE_TYPES = [QuantType.Q4_1, QuantType.Q8_0]  # the layers', the LM head's (Q4_K: test_cpu_kquant_matmul.py)


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [m, k] as the kernel quantizes it, per 32-block: int8 values, scales, scaled sums ([m, k / 32])."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1) * torch.tensor(1 / 127, dtype=torch.float32)
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse[..., None]).clamp(-127, 127)
    return q, d, d * q.sum(-1)


def i8_reference(x: torch.Tensor, blocks: torch.Tensor, qtype: QuantType, k: int) -> torch.Tensor:
    """x . W for Q4_1 / Q8_0 `blocks` with x quantized per block: sum over blocks of d_w dx (q_w . qx)
    (+ m_w sx for Q4_1), in float64 from the float32 factors."""
    data = blocks.numpy().reshape(blocks.shape[0], k // 32, qm.BLOCK_BYTES[qtype])
    d_w = torch.from_numpy(data[..., :2].copy().view(np.float16).astype(np.float32)[..., 0]).double()
    if qtype == QuantType.Q8_0:
        m_w = torch.zeros_like(d_w)
        q_w = torch.from_numpy(data[..., 2:].view(np.int8).astype(np.float64))
    else:
        m_w = torch.from_numpy(data[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]).double()
        qs = torch.from_numpy(data[..., 4:].astype(np.int64))
        q_w = torch.cat([qs & 15, qs >> 4], dim=-1).double()  # [n, blocks, 32]: weights j < 16, then j >= 16
    q, d, s = (t.double() for t in quantize_x(x))
    dots = torch.einsum("mbj,nbj->mnb", q, q_w)
    return ((d[:, None, :] * d_w[None]) * dots + m_w[None] * s[:, None, :]).sum(-1).float()


@pytest.mark.parametrize("qtype", I8_FILE_TYPES)
def test_i8_weights_are_the_files_weights_bit_for_bit(lib, qtype):
    blocks, reference = quantized(24, 96, qtype, seed=5)
    i8 = qm.to_i8_blocks(blocks, qtype, 96, lib)
    assert i8.shape == (24, 96 // 32 * qm.BLOCK_BYTES[qm.I8_OF[qtype]])
    assert torch.equal(qm.dequantize(i8, qm.I8_OF[qtype], 96, lib), reference)


@pytest.mark.parametrize("qtype", I8_FILE_TYPES)
@pytest.mark.parametrize("m, n, k", [(1, 8, 32), (2, 16, 96), (3, 24, 576), (4, 8, 64), (5, 40, 160), (13, 16, 32),
                                     (70, 8, 64)])
def test_i8_matmul_is_int8_x_against_the_exact_weights(lib, qtype, m, n, k):
    blocks, weight = quantized(n, k, qtype, seed=m + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 3
    x[m - 1, : 32 if m > 1 else 0] = 0.0  # a block of zeros quantizes to zeros, not NaN
    got = qm.matmul(x, qm.to_i8_blocks(blocks, qtype, k, lib), qm.I8_OF[qtype], k, lib)
    torch.testing.assert_close(got, i8_reference(x, blocks, qtype, k), rtol=1e-5, atol=1e-5 * k**0.5)
    # ... which is within int8's rounding of the float32 product, and not the float32 product itself
    # (Q8_0's scale of the block of tiny weights underflows float16: a K of 32 has only zero weights)
    exact = x @ weight.T
    if exact.norm() > 0:
        assert 1e-4 < (got - exact).norm() / exact.norm() < 2e-2


def test_q8_0_i8_takes_every_weight_byte_with_its_sign(lib):
    # The extremes of both operands: -128 (a file may hold it; |q| is then 128 unsigned) and 127
    # against x at +-127, where an unsigned-by-signed multiply saturates without the sign trick.
    k = 64
    blocks, _ = quantized(8, k, QuantType.Q8_0, seed=3)
    data = blocks.numpy().reshape(8, k // 32, 34)
    data[..., 0:2] = np.frombuffer(np.float16(0.5).tobytes(), dtype=np.uint8)  # d = 0.5
    data[..., 2:] = np.array([-128, 127, -127, 0], dtype=np.int8).view(np.uint8)[np.arange(32) % 4]
    data[1, :, 2:] = np.uint8(0x80)  # a row of -128 only
    x = torch.tensor([[127.0, -127.0, 127.0, 5.0] * (k // 4), [-1.0] * k])
    got = qm.matmul(x, qm.to_i8_blocks(blocks, QuantType.Q8_0, k, lib), QuantType.Q8_0_I8, k, lib)
    torch.testing.assert_close(got, i8_reference(x, blocks, QuantType.Q8_0, k), rtol=1e-6, atol=0)
    assert got[1, 1].item() == pytest.approx(0.5 * -128 * -1.0 * k, rel=1e-6)  # -1 quantizes to -127 (dx = 1/127)


@pytest.mark.parametrize("qtype", I8_FILE_TYPES)
@pytest.mark.parametrize("m", [2, 5, 11])
def test_an_i8_row_sums_alike_whatever_the_batch(lib, qtype, m):
    blocks, _ = quantized(16, 96, qtype, seed=m)
    i8, i8_type = qm.to_i8_blocks(blocks, qtype, 96, lib), qm.I8_OF[qtype]
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
    batch = qm.matmul(x, i8, i8_type, 96, lib)
    for i in range(m):
        assert torch.equal(qm.matmul(x[i : i + 1], i8, i8_type, 96, lib)[0], batch[i])


@pytest.mark.parametrize("qtype", I8_FILE_TYPES)
def test_linear_keeps_i8_weights_on_the_integer_tiles_at_every_row_count(lib, qtype):
    blocks, _ = quantized(16, 64, qtype, seed=2)
    i8, i8_type = qm.to_i8_blocks(blocks, qtype, 64, lib), qm.I8_OF[qtype]
    x, bias = torch.randn(max(qm.gemm_rows(lib), 2) + 1, 64), torch.randn(16)
    got = qm.linear(x, i8, i8_type, 64, bias, lib)
    assert torch.equal(got, qm.matmul(x, i8, i8_type, 64, lib) + bias)


def test_i8_sums_take_the_cpus_integer_dot_products(isa, lib):
    native_path = ("vnni-512" if native.cpu_has("avx512_vnni") and native.cpu_has("avx512bw") else
                   "vnni" if native.cpu_has("avx_vnni") or native.cpu_has("avx512_vnni") else "avx2")
    assert qm.i8_path(lib) == {"scalar": "c", "avx2": "avx2", EMULATED: "vnni-512"}.get(isa, native_path)


def test_i8_weights_are_made_of_q4_1_or_q8_0_rows_in_groups_of_8(lib):
    blocks, _ = quantized(12, 64, QuantType.Q4_1, seed=0)
    with pytest.raises(ValueError, match="groups of 8"):
        qm.to_i8_blocks(blocks, QuantType.Q4_1, 64, lib)
    with pytest.raises(ValueError, match="do not hold"):
        qm.to_i8_blocks(quantized(8, 64, QuantType.Q8_0, seed=0)[0], QuantType.Q4_1, 64, lib)
    with pytest.raises(ValueError, match="no int8 copy"):
        qm.to_i8_blocks(quantized(8, 64, QuantType.F16, seed=0)[0], QuantType.F16, 64, lib)


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_kvmesh_cpu_isa_serves_an_older_cpus_paths():
    # KVMESH_CPU_ISA=avx2 on any x86 CPU with AVX2: the served builds take their AVX2 paths and the
    # features an AVX2-only CPU lacks are denied to whoever chooses by them (--dtype auto among them).
    if not native.runs_here("avx2"):
        pytest.skip("this CPU has no AVX2")
    code = ("from kvmesh_kernels import native, cpu_quant_matmul as qm; from services.common.config import default_cache_dir; "
            "qm.build(default_cache_dir()); print(qm.isa(), native.cpu_has('avx512f'), native.cpu_has('avx2'))")
    run = functools.partial(subprocess.run, [sys.executable, "-c", code], capture_output=True, text=True)
    assert run(env={**os.environ, "KVMESH_CPU_ISA": "avx2"}).stdout.split() == ["256", "False", "True"]
    bad = run(env={**os.environ, "KVMESH_CPU_ISA": "avx9"})
    assert bad.returncode != 0 and "KVMESH_CPU_ISA must be one of native, avx2, scalar" in bad.stderr
