"""The engine end to end with the Triton attention backend (compiled on a CUDA device, under the
interpreter on the CPU; scripts/gpu_check.py makes the same check on a GPU with random folders, as
the default model is not installed there): greedy tokens identical to the
torch backend's and to Hugging Face transformers' generate(), top-5 logprobs close to the torch
backend's. A small token budget prefills the long prompt in chunks next to other requests' decodes.

On a CUDA device the model is the default one; under the interpreter, which runs each kernel's
programs in Python, a tiny Mistral (tests/model/families.py: 2 layers, 4 query heads over 2 KV
heads, a 16-token sliding window the prompts cross), so that the backends differ only in the
kernels."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from services import LLM, SamplingParams
from services.processor.tokenizer import apply_chat_template, load_tokenizer
from tests.kernels.conftest import kernels_device
from tests.model.families import Family, random_prompts
from tests.model.hf_reference import HFReference
from tests.model.prompts import CHAT_QUESTIONS, RAW_PROMPTS, long_text

MAX_NEW_TOKENS = 4
LOGPROB_TOL = 1e-3
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=5, ignore_eos=True)
ENGINE_ARGS = dict(kv_cache_memory=64 * 2**20, max_num_batched_tokens=64)
TINY_ENGINE_ARGS = dict(kv_cache_memory=4 * 2**20, max_num_batched_tokens=24)

pytestmark = pytest.mark.slow


def generate(model_path: Path, backend: str, prompts: list[list[int]], engine_args: dict):
    llm = LLM(model=str(model_path), dtype="float32", attention_backend=backend, device=str(kernels_device()),
              **engine_args)
    try:
        outputs = llm.generate(prompts, GREEDY)
        manager = llm.engine.kv_cache_manager
        manager.check_integrity()
        assert manager.block_pool.get_num_free_blocks() == len(manager.block_pool.blocks)
        return [o.outputs[0] for o in outputs]
    finally:
        del llm
        gc.collect()


def default_model_prompts(model_path: Path) -> list[list[int]]:
    tokenizer = load_tokenizer(model_path)
    return [apply_chat_template(tokenizer, [{"role": "user", "content": CHAT_QUESTIONS[0]}]),
            apply_chat_template(tokenizer, [{"role": "user", "content": CHAT_QUESTIONS[6]}]),
            tokenizer.encode(RAW_PROMPTS[1]), tokenizer.encode(long_text(2))]


@pytest.fixture(scope="module")
def case(model_path: Path, request: pytest.FixtureRequest) -> tuple[Path, list[list[int]], dict, HFReference]:
    """The model, its prompts (the last longer than a step's token budget), engine arguments and
    transformers on the same weights."""
    if kernels_device().type == "cuda":
        return model_path, default_model_prompts(model_path), ENGINE_ARGS, request.getfixturevalue("hf_reference")
    family: Family = request.getfixturevalue("model_families")["mistral"]
    return family.path, random_prompts((3, 17, 40), seed=5), TINY_ENGINE_ARGS, family.reference


def test_triton_backend_matches_torch_backend_and_transformers(case) -> None:
    model_path, prompts, engine_args, reference = case
    assert len(prompts[-1]) > engine_args["max_num_batched_tokens"], "the long prompt must be chunked"
    triton_out = generate(model_path, "triton", prompts, engine_args)
    torch_out = generate(model_path, "torch", prompts, engine_args)
    for i, (ours, theirs, prompt) in enumerate(zip(triton_out, torch_out, prompts)):
        assert len(ours.token_ids) == MAX_NEW_TOKENS, (i, ours.finish_reason)
        want = reference(prompt, ours.token_ids).token_ids  # transformers' greedy choice after each prefix
        assert ours.token_ids == want, f"prompt {i}: triton {ours.token_ids} vs transformers {want}"
        assert theirs.token_ids == ours.token_ids, f"prompt {i}: torch {theirs.token_ids} vs triton {ours.token_ids}"
        for pos, (a, b) in enumerate(zip(ours.logprobs, theirs.logprobs)):
            assert a.keys() == b.keys(), f"prompt {i}, token {pos}: top-5 differ"
            for token_id in a:
                assert abs(a[token_id].logprob - b[token_id].logprob) < LOGPROB_TOL
