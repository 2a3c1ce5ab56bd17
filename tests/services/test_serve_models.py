"""`kvmesh serve --model smollm2 --model <llama3> --model <qwen2> --model <gemma3>`: SmolLM2 and three
tiny random model families (tests/model/families.py) behind one gateway and one processor, each on an
engine+worker pair of its own, as a user runs it. One stack for the module.

The families' random weights answer unlike SmolLM2 and unlike each other, so a request routed to the
wrong pool shows as wrong tokens. Each model's answer must equal that model served alone by the
in-process `LLM`.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from services import LLM
from services.common.metrics import fetch_page
from services.common.sampling_params import SamplingParams
from tests.model.families import Family
from tests.model.prompts import long_text
from tests.services.procs import SERVE_KV_BYTES, SHARED_MAX_MODEL_LEN, Serve, greedy_token_ids, serving

SMOLLM2 = "smollm2"
FAMILIES = ("llama3", "qwen2", "gemma3")  # three model classes; each more costs a worker and an engine process
PROMPT = long_text(1)  # about 35 tokens: past Gemma 3's 16-token windows
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def stack(served_model: str, model_families: dict[str, Family]) -> Iterator[Serve]:
    families = [arg for name in FAMILIES for arg in ("--model", str(model_families[name].path))]
    names = [arg for name in (SMOLLM2, *FAMILIES) for arg in ("--served-model-name", name)]
    yield from serving(served_model, [*families, *names, "--max-model-len", str(SHARED_MAX_MODEL_LEN)])


def greedy(llm: LLM) -> list[int]:
    output = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    return output.outputs[0].token_ids


def alone(path: Path) -> list[int]:
    """The model's greedy tokens for PROMPT, served alone in this process."""
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory=SERVE_KV_BYTES, max_model_len=SHARED_MAX_MODEL_LEN)
    try:
        return greedy(llm)
    finally:
        del llm
        gc.collect()


def client(stack: Serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.api, api_key="unused", timeout=120, max_retries=0)


def test_models_lists_every_model(stack: Serve, model_families: dict[str, Family]) -> None:
    """Each with its context: --max-model-len caps a model's own, never raises it."""
    own = {name: model_families[name].reference.hf_model.config.max_position_embeddings for name in FAMILIES}
    models = client(stack).models.list().data
    assert [(m.id, m.model_extra["max_model_len"]) for m in models] == [
        (SMOLLM2, SHARED_MAX_MODEL_LEN), *((name, min(own[name], SHARED_MAX_MODEL_LEN)) for name in FAMILIES)]


def test_each_model_answers_as_it_does_alone(stack: Serve, offline: LLM, model_families: dict[str, Family]) -> None:
    """`offline` is SmolLM2 alone in this process (tests/conftest.py)."""
    expected = {SMOLLM2: greedy(offline), **{name: alone(model_families[name].path) for name in FAMILIES}}
    assert len({tuple(tokens) for tokens in expected.values()}) == len(expected)  # else a wrong pool could pass
    assert {model: greedy_token_ids(stack, model, PROMPT, MAX_TOKENS) for model in expected} == expected
    # The tiny families' folders carry no chat template: SmolLM2's own chats.
    chat = client(stack).chat.completions.create(model=SMOLLM2, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=2, temperature=0)
    assert chat.model == SMOLLM2 and chat.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError, match="chat template"):
        client(stack).chat.completions.create(model="llama3", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=2)


def test_an_unknown_model_is_404(stack: Serve) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client(stack).completions.create(model="gpt-4", prompt=PROMPT, max_tokens=1)
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"


def test_metrics_carry_each_model_name(stack: Serve) -> None:
    """Run after the requests above: each model's requests are counted under its name."""
    page = fetch_page(f"{stack.url}/metrics", 10.0)
    for model in (SMOLLM2, *FAMILIES):
        assert any(line.startswith("vllm:request_success_total{") and f'model_name="{model}"' in line
                   and not line.endswith(" 0.0") for line in page.splitlines()), page[-3000:]
    for model in (SMOLLM2, *FAMILIES):
        assert f'vllm:request_params_n_count{{model_name="{model}"}}' in page
        assert any(line.startswith("kvmesh_router_decisions_total{") and f'model_name="{model}"' in line
                   and not line.endswith(" 0.0") for line in page.splitlines()), model
