"""The quantized-weight matmul over GGML's K-quants (Q4_K, Q5_K, Q6_K: a Q4_K_M file's types) in every
build this CPU runs: dequantization bit for bit gguf-py's, the matmul a float32 matmul over those
weights up to the sum's order. Blocks come random (every bit pattern, sane float16 scales) and from
the Gemma 3 Q4_K_M file; the AVX-512 source is compiled and loaded everywhere."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvmesh_kernels import cpu_quant_matmul as qm
from kvmesh_kernels import native
from kvmesh_kernels.cpu_quant_matmul import QuantType
from services.common.config import default_cache_dir
from services.common.gguf_file import GGUFFile
from services.common.model_files import GEMMA3_MODEL, locate_model
from tests.kernels.kquant_blocks import dequantize, quantize, random_blocks
from tests.kernels.test_cpu_quant_matmul import quantize_x

K_TYPES = list(qm.K_TYPES)
VECTOR_BUILDS = [isa for isa in native.ISA_FLAGS if isa != "scalar"]
# AVX-512 F, BW, DQ and VL without the CPU's own extras: the kernel's 512-bit path on any compiler.
AVX512_FLAGS = ("-march=x86-64-v4",)


@pytest.fixture
def lib(isa: str) -> ctypes.CDLL:
    return qm.variant(isa, default_cache_dir())


def k_blocks(rows: int, cols: int, qtype: QuantType, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random [rows, cols] K-quant blocks and gguf-py's dequantization of them."""
    blocks = random_blocks(rows, cols, qtype, np.random.default_rng(seed))
    return torch.from_numpy(blocks), torch.from_numpy(dequantize(blocks, qtype, cols))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("qtype", K_TYPES)
def test_k_blocks_dequantize_to_gguf_bit_for_bit(lib, qtype):
    blocks, reference = k_blocks(13, 768, qtype, seed=int(qtype))
    assert torch.equal(bits(qm.dequantize(blocks, qtype, 768, lib)), bits(reference))


@pytest.mark.parametrize("qtype", K_TYPES)
@pytest.mark.parametrize("m, n, k", [(1, 1, 256), (1, 37, 512), (2, 5, 256), (3, 17, 768), (5, 3, 256),
                                     (9, 6, 512), (33, 19, 256)])
def test_k_matmul_is_a_float32_matmul_over_the_dequantized_weights(lib, qtype, m, n, k):
    # n and m off the tiles' 4 output rows and 2 or 4 rows of x: the partial tiles at both edges.
    blocks, weight = k_blocks(n, k, qtype, seed=m * n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    got = qm.matmul(x, blocks, qtype, k, lib)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, (x.double() @ weight.double().T).float(), rtol=1e-5, atol=1e-5 * k**0.5)


@pytest.mark.parametrize("isa", VECTOR_BUILDS, indirect=True)
@pytest.mark.parametrize("qtype", K_TYPES)
def test_a_k_row_sums_alike_whatever_the_batch(lib, qtype):
    blocks, _ = k_blocks(23, 512, qtype, seed=5)
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(7))
    batch = qm.matmul(x, blocks, qtype, 512, lib)
    for i in range(7):
        assert torch.equal(qm.matmul(x[i : i + 1], blocks, qtype, 512, lib)[0], batch[i])


@pytest.mark.parametrize("qtype", K_TYPES)
def test_k_linear_either_path_equals_f_linear_with_bias(lib, qtype):
    blocks, weight = k_blocks(24, 256, qtype, seed=3)
    for rows in sorted({1, qm.gemm_rows(lib)}):  # the tiles, then dequantize + torch's GEMM
        x, bias = torch.randn(rows, 256), torch.randn(24)
        got = qm.linear(x, blocks, qtype, 256, bias, lib)
        torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name, qtype", [("blk.0.attn_output.weight", QuantType.Q4_K),
                                         ("blk.0.ffn_down.weight", QuantType.Q6_K)])
def test_a_q4_k_m_files_tensors_dequantize_and_multiply_exactly(lib, name, qtype):
    tensor = GGUFFile(locate_model(GEMMA3_MODEL)).tensors[name]  # the header only: milliseconds
    assert tensor.tensor_type == qtype
    cols, rows = (int(n) for n in tensor.shape)  # 1024 x 640, 2048 x 640 (GGUF lists columns first)
    data = np.asarray(tensor.data).view(np.uint8).reshape(rows, -1)[:96]  # a slice of rows: the test stays quick
    blocks, reference = torch.from_numpy(data.copy()), torch.from_numpy(dequantize(data, qtype, cols))
    assert torch.equal(bits(qm.dequantize(blocks, qtype, cols, lib)), bits(reference))
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(cols))
    torch.testing.assert_close(qm.matmul(x, blocks, qtype, cols, lib), (x.double() @ reference.double().T).float(),
                               rtol=1e-5, atol=1e-5 * cols**0.5)


# A Q4_K_M file's K-quant layers: o_proj (Q4_K) and a down projection (Q6_K).
FILE_LAYERS = {QuantType.Q4_K: "blk.0.attn_output.weight", QuantType.Q6_K: "blk.0.ffn_down.weight"}
I8_K_TYPES = list(FILE_LAYERS)  # the K-quants with int8-activation copies (`--dtype auto` on AVX2)


def file_rows(qtype: QuantType, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gemma 3 file's first `rows` rows of its `qtype` layer and gguf-py's weights."""
    tensor = GGUFFile(locate_model(GEMMA3_MODEL)).tensors[FILE_LAYERS[qtype]]
    assert tensor.tensor_type == qtype
    cols = int(tensor.shape[0])
    data = np.asarray(tensor.data).view(np.uint8).reshape(-1, qm.row_bytes(qtype, cols))[:rows].copy()
    return torch.from_numpy(data), torch.from_numpy(dequantize(data, qtype, cols))


@pytest.mark.parametrize("source", ["random", "file"])
@pytest.mark.parametrize("qtype", I8_K_TYPES)
def test_k_quant_i8_copies_keep_the_files_weights_bit_for_bit(lib, qtype, source):
    # Q4_K as Q4_1_I8 (each sub-block of 32 a Q4_1 block with float32 scales d * sc, -dmin * m) and
    # Q6_K as Q6_K_I8 (a scale per half block): every factor an exact product
    blocks, reference = k_blocks(24, 512, qtype, seed=9) if source == "random" else file_rows(qtype, 24)
    k = reference.shape[1]
    i8 = qm.to_i8_blocks(blocks, qtype, k, lib)
    assert i8.shape == (24, k // 32 * qm.BLOCK_BYTES[qm.I8_OF[qtype]])
    assert torch.equal(bits(qm.dequantize(i8, qm.I8_OF[qtype], k, lib)), bits(reference))


@pytest.mark.parametrize("qtype", I8_K_TYPES)
@pytest.mark.parametrize("m", [1, 3, 32])
def test_k_quant_i8_copies_multiply_int8_x_against_the_exact_weights(lib, qtype, m):
    blocks, weight = file_rows(qtype, 16)
    k = weight.shape[1]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    got = qm.matmul(x, qm.to_i8_blocks(blocks, qtype, k, lib), qm.I8_OF[qtype], k, lib)
    q, d, _ = quantize_x(x)  # x as the kernel rounds it, per 32-block
    rounded_x = (q * d[..., None]).reshape(m, k).double()
    torch.testing.assert_close(got, (rounded_x @ weight.double().T).float(), rtol=1e-5, atol=1e-5 * k**0.5)


def test_q6_k_i8_sums_its_largest_products_without_overflow(lib):
    # Four vectors of products of a half block add up in 16-bit lanes: at q = -32 against x = 127,
    # 4 * 2 * 32 * 127 = 32,512, just inside them
    blocks = random_blocks(8, 256, QuantType.Q6_K, np.random.default_rng(0)).reshape(8, 210)
    blocks[:, :192] = 0  # every q - 32 = -32
    blocks[:, 192:208] = np.uint8(127)
    blocks[:, 208:210] = np.frombuffer(np.float16(2**-10).tobytes(), dtype=np.uint8)
    blocks_t, weight = torch.from_numpy(blocks), torch.from_numpy(dequantize(blocks, QuantType.Q6_K, 256))
    x = torch.ones(2, 256)
    got = qm.matmul(x, qm.to_i8_blocks(blocks_t, QuantType.Q6_K, 256, lib), QuantType.Q6_K_I8, 256, lib)
    torch.testing.assert_close(got, x @ weight.T, rtol=1e-5, atol=0)  # x = 1 quantizes to 127 * (1 / 127)


@pytest.mark.parametrize("qtype", K_TYPES)
def test_the_test_quantizer_packs_what_gguf_unpacks(qtype):
    # The model tests quantize float weights with tests/kernels/kquant_blocks.py: gguf-py must read
    # back about the same weights (4, 5 and 6 bits: a few percent off at most).
    values = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32)
    back = dequantize(quantize(values, qtype), qtype, 512)
    assert np.linalg.norm(back - values) / np.linalg.norm(values) < {QuantType.Q4_K: 0.1, QuantType.Q5_K: 0.05,
                                                                     QuantType.Q6_K: 0.03}[qtype]


def test_k_rows_are_whole_super_blocks():
    assert qm.row_bytes(QuantType.Q4_K, 512) == 288 and qm.row_bytes(QuantType.Q6_K, 256) == 210
    with pytest.raises(ValueError, match="not a whole number of 256-weight Q5_K blocks"):
        qm.row_bytes(QuantType.Q5_K, 288)


def test_the_avx512_build_compiles_and_loads_on_any_x86_host():
    # Its tiles run where the CPU has AVX-512 (there the native build is this path and every test
    # above runs it); elsewhere the source must still compile, and its scalar entry points answer.
    if not native.cpu_has("avx2"):
        pytest.skip("not an x86-64 host with AVX2: -march=x86-64-v4 is x86's")
    lib = qm._declare(native.load(qm._NAME, (*qm._BASE_FLAGS, *AVX512_FLAGS), default_cache_dir()))
    assert qm.isa(lib) == 512  # `_declare` also checked every type's block bytes, K-quants included
