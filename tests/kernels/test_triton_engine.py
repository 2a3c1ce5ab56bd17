"""The engine end to end with the Triton attention backend (compiled on a CUDA device, under the
interpreter on the CPU; scripts/gpu_check.py runs it on the GPU): greedy tokens identical to the torch backend's and to Hugging Face transformers' generate(), top-5
logprobs close to the torch backend's. A short case: four prompts, four new tokens, and a small
token budget so that prompts are prefilled in chunks next to other requests' decodes."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from services import LLM, SamplingParams
from services.processor.tokenizer import apply_chat_template
from tests.kernels.conftest import kernels_device
from tests.model.hf_reference import HFReference
from tests.model.prompts import CHAT_QUESTIONS, RAW_PROMPTS, long_text

MAX_NEW_TOKENS = 4
LOGPROB_TOL = 1e-3
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=5)
ENGINE_ARGS = dict(kv_cache_memory=64 * 2**20, max_num_batched_tokens=64)

pytestmark = pytest.mark.slow


def generate(model_path: Path, backend: str, prompts: list[list[int]] | None = None):
    llm = LLM(model=str(model_path), dtype="float32", attention_backend=backend, device=str(kernels_device()),
              **ENGINE_ARGS)
    try:
        if prompts is None:
            tokenizer = llm.get_tokenizer()
            prompts = [
                apply_chat_template(tokenizer, [{"role": "user", "content": CHAT_QUESTIONS[0]}]),
                apply_chat_template(tokenizer, [{"role": "user", "content": CHAT_QUESTIONS[6]}]),
                tokenizer.encode(RAW_PROMPTS[1]),
                tokenizer.encode(long_text(2)),
            ]
        outputs = llm.generate(prompts, GREEDY)
        manager = llm.engine.kv_cache_manager
        manager.check_integrity()
        assert manager.block_pool.get_num_free_blocks() == len(manager.block_pool.blocks)
        return prompts, [o.outputs[0] for o in outputs], llm.processor.info.eos_token_ids
    finally:
        del llm
        gc.collect()


def test_triton_backend_matches_torch_backend_and_transformers(model_path: Path, hf_reference: HFReference) -> None:
    prompts, triton_out, _ = generate(model_path, "triton")
    assert len(prompts[-1]) > ENGINE_ARGS["max_num_batched_tokens"], "the long prompt must be chunked"
    _, torch_out, _ = generate(model_path, "torch", prompts)
    for i, (ours, theirs, prompt) in enumerate(zip(triton_out, torch_out, prompts)):
        want = hf_reference(prompt, ours.token_ids).token_ids  # transformers' greedy choice after each prefix
        assert ours.token_ids == want, f"prompt {i}: triton {ours.token_ids} vs transformers {want}"
        assert theirs.token_ids == ours.token_ids, f"prompt {i}: torch {theirs.token_ids} vs triton {ours.token_ids}"
        for pos, (a, b) in enumerate(zip(ours.logprobs, theirs.logprobs)):
            assert a.keys() == b.keys(), f"prompt {i}, token {pos}: top-5 differ"
            for token_id in a:
                assert abs(a[token_id].logprob - b[token_id].logprob) < LOGPROB_TOL
