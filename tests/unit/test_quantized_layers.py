"""The layers given GGUF blocks (services/worker/layers/quantized_weight.py): they keep them where
the kernel reads them (one type for the whole weight, columns cut between blocks, float32) and
compute what F.linear / F.embedding compute over the dequantized weight; otherwise they hold the
dequantized floats, exactly the converted folder's."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvmesh_kernels import cpu_quant_matmul
from kvmesh_kernels.cpu_quant_matmul import QuantType
from kvmesh_kernels.native import cpu_has
from services.common.config import ModelConfig, default_cache_dir
from services.worker.gguf_weights import LoadQuantizedWeights, block_gemm_dtype, resolve_dtype
from services.worker.layers.linear import MergedLinear, RowParallelLinear, ShardRows
from services.worker.layers.quantized_weight import LOW_PRECISION_GEMM_ROWS, GGUFBlocks, use_gemm_dtype
from services.worker.layers.vocab_parallel_embedding import VocabParallelEmbedding
from services.worker.parallel_group import TensorParallelGroup

HIDDEN = 64


@pytest.fixture(autouse=True, scope="module")
def _kernel_built() -> None:
    cpu_quant_matmul.build(default_cache_dir())  # raises, saying why, where it cannot


def blocks(rows: int, cols: int, qtype: QuantType, seed: int) -> tuple[GGUFBlocks, torch.Tensor]:
    values = np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32)
    data = gguf.quants.quantize(values, gguf.GGMLQuantizationType(qtype)).view(np.uint8).reshape(rows, -1)
    source = GGUFBlocks(qtype, data, cols)
    return source, source.dequantize()


def qkv_layer(dtype: torch.dtype = torch.float32) -> MergedLinear:
    # This rank's rows [2, 5) of q and [1, 3) of k and v, as a tensor-parallel split would give.
    return MergedLinear(HIDDEN, {"q": ShardRows(2, 3, 6), "k": ShardRows(1, 2, 4), "v": ShardRows(1, 2, 4)},
                        False, dtype)


def test_merged_layer_keeps_its_shards_blocks_and_computes_over_their_rows():
    layer = qkv_layer()
    sources = {"q": blocks(6, HIDDEN, QuantType.Q4_1, 0), "k": blocks(4, HIDDEN, QuantType.Q4_1, 1),
               "v": blocks(4, HIDDEN, QuantType.Q4_1, 2)}
    for shard, (source, _) in sources.items():
        assert layer.block_weight is None  # kept only once the last shard is in
        layer.load_shard(layer.weight, shard, source, shard)
    assert layer.weight is None and layer.block_weight.qtype == QuantType.Q4_1
    # A linear layer's Q4_1 blocks are repacked for the kernel where that build is faster with them.
    assert layer.block_weight.packed == cpu_quant_matmul.packs_faster()
    whole = torch.cat([sources["q"][1][2:5], sources["k"][1][1:3], sources["v"][1][1:3]])
    assert torch.equal(layer.block_weight.dequantize(), whole)
    x = torch.randn(3, HIDDEN)
    torch.testing.assert_close(layer(x), F.linear(x, whole), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["mixed types", "one shard as floats", "bfloat16 layer"])
def test_merged_layer_falls_back_to_the_dequantized_floats(case):
    layer = qkv_layer(torch.bfloat16 if case == "bfloat16 layer" else torch.float32)
    q, q_floats = blocks(6, HIDDEN, QuantType.Q4_1, 0)
    k, k_floats = blocks(4, HIDDEN, QuantType.Q8_0 if case == "mixed types" else QuantType.Q4_1, 1)
    v, v_floats = blocks(4, HIDDEN, QuantType.Q4_1, 2)
    layer.load_shard(layer.weight, "q", q, "q")
    layer.load_shard(layer.weight, "k", k_floats if case == "one shard as floats" else k, "k")
    layer.load_shard(layer.weight, "v", v, "v")
    assert layer.block_weight is None
    want = torch.cat([q_floats[2:5], k_floats[1:3], v_floats[1:3]]).to(layer.weight.dtype)
    assert torch.equal(layer.weight, want)


@pytest.mark.parametrize("col_start, cols, kept", [(32, 64, True), (16, 64, False)])
def test_row_parallel_layer_keeps_blocks_only_for_columns_cut_between_blocks(col_start, cols, kept):
    layer = RowParallelLinear(cols, HIDDEN, True, torch.float32, TensorParallelGroup(), col_start, 128)
    source, floats = blocks(HIDDEN, 128, QuantType.Q8_0, 3)
    bias = torch.randn(HIDDEN)
    layer.load_param(layer.weight, source, "down")
    layer.load_param(layer.bias, bias, "down.bias")
    assert (layer.block_weight is not None) == kept
    x = torch.randn(5, cols)
    torch.testing.assert_close(layer(x), F.linear(x, floats[:, col_start : col_start + cols], bias),
                               rtol=1e-5, atol=1e-5)


def test_embedding_in_blocks_looks_up_exact_rows_and_computes_logits():
    layer = VocabParallelEmbedding(50, HIDDEN, torch.float32, TensorParallelGroup())
    source, floats = blocks(50, HIDDEN, QuantType.Q8_0, 4)
    layer.load_param(layer.weight, source, "embed")
    assert layer.weight is None
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(layer(ids), floats[ids])
    hidden = torch.randn(2, HIDDEN)
    torch.testing.assert_close(layer.logits(hidden), hidden @ floats.T, rtol=1e-5, atol=1e-5)


def test_blocks_of_the_wrong_shape_are_refused():
    layer = qkv_layer()
    with pytest.raises(ValueError, match="has shape"):
        layer.load_shard(layer.weight, "q", blocks(7, HIDDEN, QuantType.Q4_1, 0)[0], "q_proj")
    with pytest.raises(ValueError, match="block boundaries"):
        blocks(4, HIDDEN, QuantType.Q4_1, 0)[0][:, 8:40]


def test_int8_quantizes_every_2d_weight_to_q8_0_blocks_and_passes_the_rest():
    weight, norm, odd = torch.randn(8, HIDDEN), torch.randn(HIDDEN), torch.randn(4, 40)
    given = [("a.weight", weight), ("n.weight", norm), ("o.weight", odd)]
    out = dict(LoadQuantizedWeights(QuantType.Q8_0).overlay(iter(given)))
    assert out["n.weight"] is norm and out["o.weight"] is odd  # 1-D, or rows not of whole blocks
    blocks = out["a.weight"]
    assert isinstance(blocks, GGUFBlocks) and blocks.qtype == QuantType.Q8_0 and blocks.shape == (8, HIDDEN)
    scales = weight.reshape(8, -1, 32).abs().amax(-1, keepdim=True) / 127  # per block of 32
    error = (blocks.dequantize() - weight).reshape(8, -1, 32).abs()
    # Half a step of rounding, plus the scale's own f16 rounding (2^-11 relative) times up to 127 steps.
    assert (error <= scales * (0.5 + 127 * 2**-11)).all()


def test_f16_rounds_every_2d_weight_to_float16():
    weight = torch.randn(8, HIDDEN)
    blocks = dict(LoadQuantizedWeights(QuantType.F16).overlay(iter([("a.weight", weight)])))["a.weight"]
    assert blocks.qtype == QuantType.F16 and torch.equal(blocks.dequantize(), weight.half().float())


def test_dtype_auto_is_float32_for_blocks_and_bfloat16_only_with_its_instructions(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a Hugging Face folder, as far as locate_model looks
    cpu = torch.device("cpu")
    floats = torch.bfloat16 if cpu_has("avx512_bf16") or cpu_has("amx_bf16") else torch.float32
    assert resolve_dtype("auto", "auto", "smollm2", cpu) == torch.float32  # the GGUF file's blocks
    assert resolve_dtype("auto", "int8", str(tmp_path), cpu) == torch.float32  # blocks made at load
    assert resolve_dtype("auto", "none", "smollm2", cpu) == floats
    assert resolve_dtype("auto", "auto", str(tmp_path), cpu) == floats
    assert resolve_dtype("bfloat16", "auto", "smollm2", cpu) == torch.bfloat16  # asked for: as asked
    assert ModelConfig(dtype="auto", quantization="gguf").dtype == "auto"


def test_dtype_auto_multiplies_larger_steps_in_the_fastest_copy_the_cpu_allows(monkeypatch, caplog):
    cpu = torch.device("cpu")
    proposed = {}
    if cpu_has("avx512_bf16") or cpu_has("amx_bf16"):
        proposed[QuantType.BF16] = torch.bfloat16
    if cpu_has("avx2", "fma", "f16c"):
        proposed[QuantType.Q4_1_I8] = torch.int8
    fastest = cpu_quant_matmul.fastest_copy(tuple(proposed)) if proposed else None
    assert block_gemm_dtype("auto", cpu) == proposed.get(fastest, torch.float32)
    assert block_gemm_dtype("float32", cpu) == torch.float32  # the default stays exact
    # Whichever the probe picks is taken, and the worker's log says which
    for qtype in proposed:
        monkeypatch.setattr(cpu_quant_matmul, "fastest_copy", lambda types, _pick=qtype: _pick)
        with caplog.at_level("INFO", logger="services.worker.gguf_weights"):
            assert block_gemm_dtype("auto", cpu) == proposed[qtype]
        assert f"larger steps multiply in {str(proposed[qtype]).removeprefix('torch.')}" in caplog.text


def test_dtype_auto_keeps_float32_where_the_copies_measure_slower(monkeypatch, caplog):
    monkeypatch.setattr(cpu_quant_matmul, "fastest_copy", lambda _copy_types: None)
    with caplog.at_level("INFO", logger="services.worker.gguf_weights"):
        assert block_gemm_dtype("auto", torch.device("cpu")) == torch.float32
    if cpu_has("avx2", "fma", "f16c"):  # a copy was proposed, and declined with a reason
        assert "measured no faster than the float32 tiles" in caplog.text


def test_bfloat16_copies_take_steps_from_their_threshold():
    layer = qkv_layer()
    for shard, (start, size) in layer.shard_offsets.items():
        source, _ = blocks(layer.shards[shard].total, HIDDEN, QuantType.Q8_0, seed=start)
        layer.load_shard(layer.weight, shard, source, f"{shard}.weight")
    exact = layer.block_weight
    assert use_gemm_dtype([layer, qkv_layer()], torch.bfloat16) == 1  # the one holding blocks
    fast = layer.block_weight
    threshold = LOW_PRECISION_GEMM_ROWS[QuantType.BF16]
    assert fast.gemm_weight.qtype == QuantType.BF16 and fast.gemm_rows == threshold
    assert exact.gemm_weight is None and exact.gemm_rows == cpu_quant_matmul.gemm_rows()
    weight, bias = exact.dequantize(), torch.randn(exact.rows)
    for rows in (1, threshold - 1):  # the kernel's tiles: float32 over the exact weight
        x = torch.randn(rows, HIDDEN)
        assert torch.equal(fast.linear(x, bias), exact.linear(x, bias))
    # From the threshold, the BF16 tiles: W rounded to bfloat16 (and x too, where the dot products
    # take it), float32 sums
    x = torch.randn(2, threshold, HIDDEN)
    want = F.linear(x.bfloat16().float() if cpu_quant_matmul.bf16_dot() else x, weight.bfloat16().float()) + bias
    torch.testing.assert_close(fast.linear(x, bias), want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(fast.linear(x, bias), exact.linear(x, bias), rtol=1e-4, atol=1e-4)
    x = torch.randn(cpu_quant_matmul.gemm_rows(), HIDDEN)  # then torch's bfloat16 GEMM
    assert torch.equal(fast.linear(x, bias), F.linear(x.bfloat16(), weight.bfloat16()).float() + bias)


def test_int8_copies_are_the_q4_1_and_q8_0_weights_against_int8_x_from_two_rows():
    def gate_up(qtype: QuantType) -> MergedLinear:
        layer = MergedLinear(HIDDEN, {"gate": ShardRows.whole(8), "up": ShardRows.whole(8)}, True, torch.float32)
        for i, shard in enumerate(layer.shards):
            layer.load_shard(layer.weight, shard, blocks(8, HIDDEN, qtype, seed=i)[0], f"{shard}.weight")
            layer.load_shard(layer.bias, shard, torch.randn(8, generator=torch.Generator().manual_seed(i)),
                             f"{shard}.bias")
        return layer

    layer, q8_layer, f16_layer, odd_rows = (gate_up(QuantType.Q4_1), gate_up(QuantType.Q8_0), gate_up(QuantType.F16),
                                            qkv_layer())
    for shard, (start, _) in odd_rows.shard_offsets.items():  # 7 rows: not whole groups of 8
        odd_rows.load_shard(odd_rows.weight, shard, blocks(odd_rows.shards[shard].total, HIDDEN, QuantType.Q4_1,
                                                           seed=start)[0], shard)
    exact, exact_q8 = layer.block_weight, q8_layer.block_weight
    # Q4_1 and Q8_0 rows in groups of 8 only
    assert use_gemm_dtype([layer, q8_layer, f16_layer, odd_rows], torch.int8) == 2
    assert f16_layer.block_weight.gemm_weight is None and odd_rows.block_weight.gemm_weight is None
    assert q8_layer.block_weight.gemm_weight.qtype == QuantType.Q8_0_I8
    assert torch.equal(q8_layer.block_weight.gemm_weight.dequantize(), exact_q8.dequantize())
    fast = layer.block_weight
    assert fast.gemm_weight.qtype == QuantType.Q4_1_I8 and fast.gemm_rows == 2
    assert torch.equal(fast.gemm_weight.dequantize(), exact.dequantize())  # the same weights
    x, bias = torch.randn(1, HIDDEN), layer.bias.detach()
    assert torch.equal(fast.linear(x, bias), exact.linear(x, bias))  # a lone row: float32, exact
    x = torch.randn(3, 2, HIDDEN)
    got = fast.linear(x, bias)
    assert torch.equal(got, cpu_quant_matmul.matmul(x.reshape(6, HIDDEN), fast.gemm_weight.blocks,
                                                    QuantType.Q4_1_I8, HIDDEN).reshape(3, 2, 16) + bias)
    exact_y = exact.linear(x, bias)
    assert 1e-4 < (got - exact_y).norm() / exact_y.norm() < 2e-2  # int8's rounding of x, no more
