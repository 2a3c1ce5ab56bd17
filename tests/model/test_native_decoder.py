"""The decoder stack as one native call (services/worker/native_decoder.py) against the layers'
modules it replaces on the CPU's small steps: the same kernels in the same order, so the same bits.
The default model (its GGUF file's blocks) generates with the native path and again without it:
every token and every logprob is equal, over decode steps of many sequences, prefill chunks mixed
with decodes, and prompt logprobs; steps of more tokens than the GEMM threshold keep the modules. And `--dtype auto`,
whose larger steps multiply in bfloat16 or int8 where the CPU has their instructions."""

from __future__ import annotations

import gc

import pytest
import torch

from kvmesh_kernels import cpu_paged_attention, cpu_quant_matmul
from kvmesh_kernels.cpu_quant_matmul import QuantType
from services import LLM, SamplingParams
from services.worker.attention.torch_backend import NativeAttentionPlan
from services.worker.forward_context import ForwardContext, set_forward_context
from services.worker.gguf_weights import block_gemm_dtype
from services.worker.layers.linear import MergedLinear, RowParallelLinear
from services.worker.layers.quantized_weight import use_gemm_dtype
from services.worker.native_decoder import NativeDecoder
from services.worker.worker import gemm_dtype_layers

KV_BYTES = 64 << 20


@pytest.fixture(scope="module")
def llm():
    # A small step budget: the prompts are read in chunks beside the other requests' decodes.
    engine = LLM(model="smollm2", dtype="float32", quantization="gguf", kv_cache_memory=KV_BYTES, max_num_batched_tokens=48,
                 max_num_seqs=8)
    yield engine
    del engine
    gc.collect()


def model_of(llm: LLM):
    return llm.worker.runner.model.model


def generate(llm: LLM, native: NativeDecoder | None, prompts: list[list[int]], params: SamplingParams):
    model = model_of(llm)
    served, model.native_decoder = model.native_decoder, native
    try:
        return llm.generate(prompts, params)
    finally:
        model.native_decoder = served


def test_the_default_model_on_the_cpu_takes_the_native_decoder(llm: LLM):
    assert isinstance(model_of(llm).native_decoder, NativeDecoder)


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_native_and_module_paths_give_the_same_tokens_and_logprobs(llm: LLM):
    served = model_of(llm).native_decoder
    assert served is not None
    calls = []
    native = NativeDecoder(model_of(llm), served.ops)  # its own, to count its steps
    native.forward = lambda hidden, cos_sin: calls.append(hidden.shape[0]) or served.forward(hidden, cos_sin)
    tokenizer = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
             "1, 2, 3, 5, 8,", "A short story about a robot who learns to paint. " * 3]
    prompts = [tokenizer.encode(t) for t in texts]
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)]
    with_native = generate(llm, native, prompts, params)
    assert calls and max(calls) > 8 and 1 in calls  # chunks mixed with decodes; one sequence decoding alone
    without = generate(llm, None, prompts, params)
    for a, b in zip(with_native, without):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # floats equal to the last bit
        assert a.prompt_logprobs == b.prompt_logprobs


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_int8_copies_take_the_same_bits_natively_and_through_the_modules(llm: LLM):
    # `--dtype auto` on an AVX2-only CPU (quantized_weight.use_gemm_dtype(..., torch.int8)), given to
    # this model's layers on any CPU for the length of the test.
    model, causal_lm = model_of(llm), llm.worker.runner.model
    layers = gemm_dtype_layers(causal_lm)
    exact = [layer.block_weight for layer in layers]
    try:
        assert use_gemm_dtype(layers, torch.int8) == len(layers)  # every layer is Q4_1, the LM head Q8_0
        assert causal_lm.lm_head.block_weight.gemm_weight.qtype == QuantType.Q8_0_I8
        native = NativeDecoder(model, model.native_decoder.ops)
        assert native.low_precision_from == 2
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):", "1, 2, 3, 5, 8,")]
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
        with_native, without = generate(llm, native, prompts, params), generate(llm, None, prompts, params)
        for a, b in zip(with_native, without):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].logprobs == b.outputs[0].logprobs
    finally:
        for layer, weight in zip(layers, exact):
            layer.block_weight = weight
    exact_out = generate(llm, None, prompts, params)
    # int8's rounding moves the logprobs, not (on these prompts) the first greedy tokens
    assert [o.outputs[0].token_ids[:4] for o in exact_out] == [o.outputs[0].token_ids[:4] for o in with_native]
    assert any(a.outputs[0].logprobs != b.outputs[0].logprobs for a, b in zip(exact_out, with_native))


def test_steps_of_many_tokens_go_through_the_modules(llm: LLM):
    native = model_of(llm).native_decoder
    hidden = torch.zeros(cpu_quant_matmul.gemm_rows(), 8)
    plan = NativeAttentionPlan(*(torch.zeros(1),) * 6, False)
    with set_forward_context(ForwardContext(None, plan, [], None)):
        assert native.forward(hidden, torch.zeros(hidden.shape[0], 64)) is None


@pytest.mark.slow  # a second model in memory
def test_dtype_auto_reads_long_prompts_in_the_cpus_low_precision(llm: LLM):
    want = block_gemm_dtype("auto", torch.device("cpu"))
    with LLM(model="smollm2", dtype="auto", kv_cache_memory=KV_BYTES) as auto:
        model = auto.worker.runner.model
        layers = [m for m in model.modules() if isinstance(m, (MergedLinear, RowParallelLinear))]
        copies = {None if m.block_weight.gemm_weight is None else m.block_weight.gemm_weight.qtype for m in layers}
        assert layers and copies == {{torch.bfloat16: QuantType.BF16, torch.int8: QuantType.Q4_1_I8}.get(want)}
        head = model.lm_head.block_weight.gemm_weight  # the logits of larger steps in the same arithmetic
        want_head = {torch.bfloat16: QuantType.BF16, torch.int8: QuantType.Q8_0_I8}.get(want)
        assert (None if head is None else head.qtype) == want_head
        # Prompt attention's products in bfloat16 where the kernel has them; never in the exact mode.
        assert auto.worker.backend.prefill_bf16 == cpu_paged_attention.prefill_bf16_built()
        assert not llm.worker.backend.prefill_bf16
        prompt = llm.get_tokenizer().encode("The history of the river and its bridges. " * 60)
        assert len(prompt) > cpu_quant_matmul.gemm_rows()  # read through the modules
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
        fast, exact = auto.generate([prompt], params)[0], llm.generate([prompt], params)[0]
    assert len(fast.outputs[0].token_ids) == 8
    if want == torch.float32:  # no low-precision instructions: auto is the exact path
        assert fast.outputs[0].token_ids == exact.outputs[0].token_ids
