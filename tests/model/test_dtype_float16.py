"""`--dtype float16` (vLLM's `half`) on the CPU against transformers on the same float16 weights (the
default model in float32 arithmetic, the tiny families in float16), by teacher forcing: float16
weights, activations and KV cache, the CPU's float32 arithmetic between roundings
(kvmesh_kernels/cpu_quant_matmul.py `linear_f16`, the float16 paths of the attention and fused
kernels). Implementations that round at other places or sum in other orders are held to agreement,
not identity:

    top-1 agreement  >= MIN_AGREEMENT: our greedy token is the reference's argmax given our prefix
    logprob error    our top-5 logprobs against the reference's: mean <= MAX_MEAN_ERROR,
                     p99 <= MAX_P99_ERROR

The default model over a slice of the equivalence prompts (tests/model/prompts.py), and every family's
tiny random model (tests/model/families.py) through chunked prefill, preemption and a prefix-cache hit.
Measured on the AVX2-only EPYC: the default model 286/286 tokens agreeing, logprob error mean 0.007,
p99 0.027; the families 0.9875 and up (2 partings of 160 at worst), mean 0.007 and p99 0.027 at most.
The error bounds leave about three times that. That float16 is what ran (weights, KV cache, the
native attention) is asserted on the worker itself.
"""

from __future__ import annotations

import copy
import gc
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services import LLM, SamplingParams
from services.processor.tokenizer import apply_chat_template, load_tokenizer
from tests.model.families import BATCHED_TOKENS, FAMILIES, KV_BLOCKS, Family, run_scenario
from tests.model.hf_reference import Agreement, HFReference, agreement
from tests.model.prompts import conversations, raw_prompts

MAX_NEW_TOKENS = 32
MIN_AGREEMENT = 0.98
MAX_MEAN_ERROR = 0.02
MAX_P99_ERROR = 0.1


def assert_float16_agreement(scored: Agreement) -> None:
    assert scored.rate >= MIN_AGREEMENT, f"top-1 agreement {scored.agree}/{scored.positions}"
    mean, p99 = scored.errors.mean().item(), scored.errors.quantile(0.99).item()
    assert mean <= MAX_MEAN_ERROR and p99 <= MAX_P99_ERROR, (mean, p99)


def float16_is_what_ran(llm: LLM) -> None:
    """The worker kept float16 weights and KV cache, behind the native attention kernel."""
    worker = llm.worker
    assert worker.dtype == torch.float16 and worker.backend.name == "cpu"
    assert all(cache.dtype == torch.float16 for cache in worker.runner.kv_caches)
    assert {p.dtype for p in worker.model.parameters()} <= {torch.float16, torch.float32}  # Gemma's norms: float32


@pytest.mark.slow  # transformers in float16 on a CPU is slow: `make test`, not test-fast
def test_the_default_model_in_float16_agrees_with_transformers_on_its_weights(model_path: Path) -> None:
    tokenizer = load_tokenizer(model_path)
    chats = [apply_chat_template(tokenizer, c) for c in conversations()]
    raw = [tokenizer.encode(p) for p in raw_prompts()]
    # Four of each kind, and the third longest (268 tokens: prefill chunks over many blocks). Longer
    # ones cost transformers' float16 matmuls on the CPU (several times float32's) a minute more.
    prompts = chats[:4] + raw[:4] + sorted(chats + raw, key=len)[-3:-2]
    llm = LLM(model=str(model_path), dtype="half", kv_cache_memory=64 * 2**20, max_num_batched_tokens=256)
    try:
        float16_is_what_ran(llm)
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=5))
    finally:
        del llm
        gc.collect()
    # transformers over the same float16 weights, in float32: the truth float16's roundings are measured
    # against (transformers' own float16 matmuls on a CPU took 3x as long and gave the same agreement).
    hf_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float16).float().eval()
    scored = agreement(HFReference(hf_model), prompts, outputs)
    print(f"--dtype float16: {scored.summary()}")
    assert_float16_agreement(scored)


@pytest.mark.slow  # the families once more, in float16: `make test`, not test-fast
@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_in_float16_through_chunks_preemption_and_prefix_hits(
        model_families: dict[str, Family], name: str) -> None:
    family = model_families[name]
    # float16 blocks are half float32's bytes: the same number of blocks as the float32 test's.
    llm = LLM(model=str(family.path), dtype="float16", kv_cache_memory=KV_BLOCKS * family.block_bytes // 2,
              max_num_batched_tokens=BATCHED_TOKENS)
    try:
        float16_is_what_ran(llm)
        scenario = run_scenario(llm)
    finally:
        del llm
        gc.collect()
    reference = HFReference(copy.deepcopy(family.reference.hf_model).to(torch.float16))
    scored = agreement(reference, *scenario)
    print(f"{name} in float16: {scored.summary()}")
    assert_float16_agreement(scored)
