"""Gemma 3's per-layer windows on the Triton backend (compiled on a CUDA device, interpreted on the
CPU): a tiny random Gemma 3 whose 16-token windows (tests/model/tiny_gemma3.py) short prompts cross,
prefilled in chunks next to other requests' decodes, gives transformers' greedy tokens and the torch
backend's top-5 logprobs."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from services import LLM, SamplingParams
from tests.kernels.conftest import kernels_device
from tests.model.hf_reference import HFReference
from tests.model.tiny_gemma3 import WINDOW, save_tiny_gemma3

MAX_NEW_TOKENS = 6
LOGPROB_TOL = 1e-3
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> tuple[Path, HFReference]:
    folder = tmp_path_factory.mktemp("tiny-gemma3")
    return folder, save_tiny_gemma3(folder, model_path)


def generate(folder: Path, backend: str, prompts: list[list[int]]):
    llm = LLM(model=str(folder), dtype="float32", attention_backend=backend, device=str(kernels_device()),
              kv_cache_memory=2**20, max_num_batched_tokens=16)
    try:
        outputs = [o.outputs[0] for o in llm.generate(prompts, GREEDY)]
        llm.engine.kv_cache_manager.check_integrity()
        return outputs
    finally:
        del llm
        gc.collect()


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_triton_backend_runs_gemma3_windows_as_transformers(tiny: tuple[Path, HFReference]) -> None:
    folder, reference = tiny
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(100, 40_000, (n,), generator=gen).tolist() for n in (5, WINDOW + 1, 2 * WINDOW + 7)]
    triton_out = generate(folder, "triton", prompts)
    torch_out = generate(folder, "torch", prompts)
    for i, (ours, theirs, prompt) in enumerate(zip(triton_out, torch_out, prompts)):
        assert len(ours.token_ids) == MAX_NEW_TOKENS
        want = reference(prompt, ours.token_ids).token_ids
        assert ours.token_ids == want, f"prompt {i}: triton {ours.token_ids} vs transformers {want}"
        assert theirs.token_ids == ours.token_ids, f"prompt {i}: torch {theirs.token_ids} vs triton {ours.token_ids}"
        for a, b in zip(ours.logprobs, theirs.logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < LOGPROB_TOL for t in a)
