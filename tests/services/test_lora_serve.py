"""`kvmesh serve --enable-lora --lora-modules a=... b=...` on a tiny Llama (tests/model/families.py) with
two PEFT adapters made at test time (tests/model/lora_adapters.py), as a user runs it:

  - the openai client names an adapter as its model and gets the in-process LLM's tokens for it;
  - /v1/models lists each adapter after the base model, its parent the base model's served name;
  - an adapter the engine does not serve is INVALID_ARGUMENT at its gRPC edge; an unknown model a 404;
  - a bad adapter stops `kvmesh serve` at start-up (exit 2), the message naming the problem.
"""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from safetensors.torch import save_file

from services import LLM, SamplingParams
from services.common.engine_output import EngineCoreRequest
from services.common.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from services.engine.client import GrpcEngineClient
from tests.model.families import Family, random_prompts
from tests.model.lora_adapters import Adapter, save_adapter
from tests.services.procs import PYTHON, REPO_ROOT, SERVE_KV_BYTES, Serve, free_port, greedy_token_ids, serving

BASE = "tiny"
MAX_TOKENS = 6
PROMPT = random_prompts((21,), seed=11)[0]
LORA_FLAGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")


@pytest.fixture(scope="module")
def family(model_families: dict[str, Family]) -> Family:
    return model_families["llama-untied"]


@pytest.fixture(scope="module")
def adapters(family: Family, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Adapter]:
    folder = tmp_path_factory.mktemp("serve-adapters")
    return {"a": save_adapter(family.path, folder / "a", "a", 1, rank=4, use_rslora=True, seed=1),
            "b": save_adapter(family.path, folder / "b", "b", 2, rank=8, targets=("q_proj", "v_proj", "down_proj"),
                              seed=2)}


@pytest.fixture(scope="module")
def stack(family: Family, adapters: dict[str, Adapter]) -> Iterator[Serve]:
    yield from serving(family.path, ["--served-model-name", BASE, *LORA_FLAGS,
                                     "--lora-modules", adapters["a"].module, adapters["b"].module])


def client(stack: Serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.api, api_key="unused", timeout=120, max_retries=0)


def test_an_adapter_named_as_the_model_gives_the_llms_tokens(stack: Serve, family: Family,
                                                              adapters: dict[str, Adapter]) -> None:
    llm = LLM(model=str(family.path), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              kv_cache_memory=SERVE_KV_BYTES)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        expected = {name: llm.generate([PROMPT], params, lora_request=None if name == BASE else adapters[name].request)
                    [0].outputs[0].token_ids for name in (BASE, "a", "b")}
    finally:
        del llm
        gc.collect()
    assert len({tuple(t) for t in expected.values()}) == 3  # else a request run without its adapter could pass
    assert {name: greedy_token_ids(stack, name, PROMPT, MAX_TOKENS) for name in expected} == expected
    stack.wait_until_engine_idle()


def test_models_lists_the_adapters_with_their_parent(stack: Serve, adapters: dict[str, Adapter]) -> None:
    models = client(stack).models.list().data
    assert [(m.id, m.object, m.owned_by, m.root, m.model_extra["parent"]) for m in models] == [
        (BASE, "model", "kvmesh", BASE, None),
        ("a", "model", "kvmesh", str(adapters["a"].path), BASE),
        ("b", "model", "kvmesh", str(adapters["b"].path), BASE)]
    assert len({m.model_extra["max_model_len"] for m in models}) == 1


def test_an_unknown_adapter_is_invalid_argument_at_the_engine_and_an_unknown_model_404(stack: Serve) -> None:
    async def generate() -> None:
        engine = GrpcEngineClient(stack.services["engine"]["address"], timeout=10, security=stack.security)
        try:
            request = EngineCoreRequest("lora-unknown", PROMPT, SamplingParams(max_tokens=1), lora_name="nope")
            async for _ in engine.generate(request):
                pass
        finally:
            await engine.close()

    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'; this engine serves: a, b"):
        asyncio.run(generate())
    with pytest.raises(openai.NotFoundError) as caught:
        client(stack).completions.create(model="c", prompt=PROMPT, max_tokens=1)
    assert caught.value.body["code"] == "model_not_found"


def bad_adapters(good: Adapter, folder: Path) -> list[tuple[list[str], str]]:
    """(flags, the message naming the problem) per bad adapter."""
    folder.mkdir()
    no_config = folder / "no-config"
    no_config.mkdir()
    shutil.copy(good.path / ADAPTER_WEIGHTS, no_config / ADAPTER_WEIGHTS)
    no_weights = folder / "no-weights"
    no_weights.mkdir()
    shutil.copy(good.path / ADAPTER_CONFIG, no_weights / ADAPTER_CONFIG)
    lm_head = folder / "lm-head"
    shutil.copytree(good.path, lm_head)
    config = json.loads((lm_head / ADAPTER_CONFIG).read_text())
    (lm_head / ADAPTER_CONFIG).write_text(json.dumps({**config, "target_modules": ["q_proj", "lm_head"]}))
    shapes = folder / "shapes"
    shapes.mkdir()
    shutil.copy(good.path / ADAPTER_CONFIG, shapes / ADAPTER_CONFIG)
    save_file({"base_model.model.model.layers.1.mlp.up_proj.lora_A.weight": torch.zeros(4, 64),
               "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight": torch.zeros(96, 4)},
              shapes / ADAPTER_WEIGHTS)
    return [
        ([*LORA_FLAGS, "--lora-modules", f"x={folder / 'missing'}"], f"LoRA adapter folder {folder / 'missing'} does "
                                                                     "not exist"),
        ([*LORA_FLAGS, "--lora-modules", f"x={no_config}"], f"LoRA adapter folder {no_config} has no "
                                                           "adapter_config.json"),
        ([*LORA_FLAGS, "--lora-modules", f"x={no_weights}"], f"LoRA adapter folder {no_weights} has no "
                                                            "adapter_model.safetensors"),
        ([*LORA_FLAGS, "--max-lora-rank", "2", "--lora-modules", good.module],
         f"LoRA adapter {good.path} has rank 4, over --max-lora-rank 2"),
        ([*LORA_FLAGS, "--lora-modules", f"x={lm_head}"], f"LoRA adapter {lm_head} targets lm_head; supported "
                                                         "target modules: q_proj, k_proj, v_proj, o_proj, "
                                                         "gate_proj, up_proj, down_proj"),
        ([*LORA_FLAGS, "--lora-modules", f"x={shapes}"], f"LoRA adapter {shapes}: tensor "
                                                        "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight "
                                                        "has shape [96, 4], the base model expects [128, 4]"),
        (["--lora-modules", good.module], "--lora-modules needs --enable-lora"),
    ]


def test_bad_adapters_are_refused_at_start_up(family: Family, adapters: dict[str, Adapter], tmp_path: Path) -> None:
    for flags, problem in bad_adapters(adapters["a"], tmp_path / "bad"):
        done = subprocess.run([PYTHON, "-m", "services.cli", "serve", "--model", str(family.path),
                               "--port", str(free_port()), *flags],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, (flags, done.stderr[-2000:])
        assert problem in done.stderr, (flags, done.stderr[-2000:])
        assert done.stdout == ""
