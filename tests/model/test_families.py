"""Every model family kvmesh serves, as a tiny random model (tests/model/families.py), through `LLM`
against Hugging Face transformers: one engine per family chunks, preempts and hits its prefix cache,
and gives transformers' greedy tokens, top-5 logprobs within 1e-3. An architecture kvmesh does not
serve is refused at start-up, by name."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest

from services import LLM
from services.worker.models.gemma3 import Gemma3ForCausalLM
from services.worker.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from tests.model.families import (BATCHED_TOKENS, FAMILIES, KV_BLOCKS, WINDOW, Family, check_greedy, run_scenario,
                                  save_unsupported)

MODEL_CLASS = {"llama-tied": LlamaForCausalLM, "llama-untied": LlamaForCausalLM, "llama3": LlamaForCausalLM,
               "qwen2": Qwen2ForCausalLM, "mistral": MistralForCausalLM, "gemma3": Gemma3ForCausalLM}
TIED = ("llama-tied", "gemma3")  # the LM head is the embedding (Gemma 3's always is)


def config_of(family: Family) -> dict:
    return json.loads((family.path / "config.json").read_text())


# One family in test-fast; all of them, 2-3 s each, in `make test`.
FAST_FAMILY = "llama-tied"


@pytest.mark.parametrize("name", [name if name == FAST_FAMILY else pytest.param(name, marks=pytest.mark.slow)
                                  for name in FAMILIES])
def test_family_matches_transformers_through_chunks_preemption_and_prefix_hits(
        model_families: dict[str, Family], name: str) -> None:
    family = model_families[name]
    llm = LLM(model=str(family.path), dtype="float32", kv_cache_memory=KV_BLOCKS * family.block_bytes,
              max_num_batched_tokens=BATCHED_TOKENS)
    try:
        # The folder is what its name says, and the worker picked the class that serves it.
        model, config = llm.worker.model, config_of(family)
        assert type(model) is MODEL_CLASS[name]
        assert (model.lm_head is model.model.embed_tokens) == (name in TIED) == config["tie_word_embeddings"]
        assert ((config.get("rope_parameters") or {}).get("rope_type") == "llama3") == (name == "llama3")
        assert (config.get("sliding_window") == WINDOW) == (name in ("mistral", "gemma3"))
        assert (model.model.layers[0].self_attn.qkv_proj.bias is not None) == (name == "qwen2")
        scenario = run_scenario(llm)
    finally:
        del llm
        gc.collect()
    assert check_greedy(scenario, family.reference) <= 1, "more partings than float noise"


def test_an_unsupported_architecture_is_refused_by_name(model_path: Path, tmp_path: Path) -> None:
    save_unsupported(tmp_path, model_path)
    with pytest.raises(ValueError, match=r"unsupported model architecture \['GPT2LMHeadModel'\]; supported: "
                                         r"Gemma3ForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        LLM(model=str(tmp_path), dtype="float32")
