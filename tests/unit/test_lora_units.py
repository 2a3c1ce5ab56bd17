"""LoRA's small parts, state pinned after each call: the --lora-modules forms, the flags' rules, the
block hashes of adapters, the engine's step limit and registry, the worker's slots (LRU among the
adapters not in the step) and its host-memory cache (LRU)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.common.config import LoRAConfig
from services.common.flags import add_flags, build, to_argv
from services.common.hashing import hash_token_blocks
from services.common.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoRAModule, LoRARequest, parse_lora_module
from services.common.sampling_params import SamplingParams
from services.engine.lora_registry import LoRARegistry, LoRAStepLimit
from services.engine.request import Request
from services.worker.lora.cpu_cache import AdapterCache
from services.worker.lora.slots import SlotManager


def test_lora_modules_take_both_forms_and_several_per_flag() -> None:
    assert parse_lora_module("sql=/a/sql") == LoRAModule("sql", "/a/sql")
    assert parse_lora_module('{"name": "sql", "path": "/a", "base_model_name": "llama"}') == \
        LoRAModule("sql", "/a", "llama")
    for bad in ("sql", "=/a", '{"name": "x"}', '{"name": "x", "path": "/a", "rank": 4}', "{not json"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)
    parser = argparse.ArgumentParser()
    add_flags(parser, LoRAConfig, None)
    config = build(parser, LoRAConfig, parser.parse_args(
        ["--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}',
         "--lora-modules", "c=/z"]))
    assert [m.name for m in config.lora_modules] == ["a", "b", "c"]
    assert build(parser, LoRAConfig, parser.parse_args(to_argv(config))) == config  # as serve passes it on
    assert config.parents(("first", "m")) == {"a": "first", "b": "m", "c": "first"}
    assert config.modules_of("m", ("first", "m")) == (LoRAModule("b", "/y", "m"),)


@pytest.mark.parametrize("kwargs, problem", [
    ({"lora_modules": ("a=/x",)}, "--lora-modules needs --enable-lora"),
    ({"enable_lora": True, "lora_modules": ("a=/x", "a=/y")}, "names an adapter twice"),
    ({"enable_lora": True, "max_loras": 2, "max_cpu_loras": 1}, "must be at least --max-loras"),
])
def test_lora_flags_refuse_what_cannot_work(kwargs: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        LoRAConfig(**kwargs)
    with pytest.raises(ValueError, match="base model 'other', which is not served"):
        LoRAConfig(enable_lora=True, lora_modules=('{"name": "a", "path": "/x", "base_model_name": "other"}',)
                   ).parents(("m",))


def test_an_adapter_names_its_own_chain_and_no_salt_can_pass_for_it() -> None:
    tokens = list(range(40))
    base = hash_token_blocks(tokens, 16, "m")
    a = hash_token_blocks(tokens, 16, "m", lora_name="a")
    assert len(a) == 2 and not set(a) & set(base)
    assert not set(a) & set(hash_token_blocks(tokens, 16, "m", lora_name="b"))
    assert not set(a) & set(hash_token_blocks(tokens, 16, "m", cache_salt="a"))
    assert not set(a) & set(hash_token_blocks(tokens, 16, "m", cache_salt="a", lora_name="a"))
    assert hash_token_blocks(tokens, 16, "m", parent=a[0], start_block=1, lora_name="a") == a[1:]


def request(request_id: str, lora: LoRARequest | None) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(), max_tokens=1, block_size=16, lora_request=lora)


def test_the_step_limit_counts_distinct_adapters_and_not_the_base() -> None:
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    limit = LoRAStepLimit(1)
    limit.begin()
    assert limit.admits(request("1", a))
    limit.add(request("1", a))
    assert limit.admits(request("2", a)) and limit.admits(request("3", None)) and not limit.admits(request("4", b))
    limit.begin()
    assert limit.admits(request("4", b))
    assert LoRAStepLimit(None).admits(request("5", b))


def test_the_registry_numbers_modules_in_order_and_refuses_clashes() -> None:
    registry = LoRARegistry([LoRAModule("a", "/a"), LoRAModule("b", "/b")])
    assert registry.resolve("b") == LoRARequest("b", 2, "/b")
    registry.add(LoRARequest("a", 1, "/a"))  # again: nothing changes
    registry.add(LoRARequest("c", 7, "/c"))
    assert registry.names == ("a", "b", "c")
    for clash in (LoRARequest("a", 3, "/a"), LoRARequest("d", 1, "/d")):
        with pytest.raises(ValueError, match="clashes with the registered"):
            registry.add(clash)
    with pytest.raises(ValueError, match="unknown LoRA adapter 'x'; this engine serves: a, b, c"):
        registry.resolve("x")


def test_slots_evict_the_least_recently_used_adapter_not_in_the_step() -> None:
    slots = SlotManager(2)
    filled: list[tuple[int, int]] = []

    def fill(slot: int, lora_id: int) -> None:
        filled.append((slot, lora_id))

    assert slots.assign([1, 2], fill) == {1: 0, 2: 1}
    assert slots.assign([2], fill) == {2: 1}  # 1 is now the least recently used
    assert slots.assign([3], fill) == {3: 0}
    assert slots.assign([2, 3], fill) == {2: 1, 3: 0}
    assert slots.assign([1, 3], fill) == {1: 1, 3: 0}  # 2 was used last, but 3 is in the step
    assert filled == [(0, 1), (1, 2), (0, 3), (1, 1)]
    assert slots.slot_ids == [3, 1]
    with pytest.raises(ValueError, match="a step with 3 LoRA adapters; this worker has 2 slots"):
        slots.assign([1, 2, 3], fill)


BASE = {"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 4, "num_hidden_layers": 1}


def save_tiny_adapter(folder: Path, rank: int = 2) -> None:
    """A PEFT folder for BASE: q_proj of layer 0, scaling lora_alpha / r = 2."""
    folder.mkdir()
    (folder / ADAPTER_CONFIG).write_text(json.dumps({"r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj"]}))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(rank, 8),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(8, rank)},
              folder / ADAPTER_WEIGHTS)


def test_the_host_cache_keeps_the_most_recently_used(tmp_path: Path) -> None:
    cache = AdapterCache(2, 8, BASE)
    a, b, c = (LoRARequest(n, i, str(tmp_path / n)) for i, n in enumerate("abc", start=1))
    for lora in (a, b, c):
        save_tiny_adapter(Path(lora.lora_path))
    first = {lora.lora_name: cache.get(lora) for lora in (a, b)}
    assert cache.get(a) is first["a"]
    cache.get(c)  # evicts b, the least recently used
    assert 1 in cache and 3 in cache and 2 not in cache and len(cache) == 2
    assert cache.get(b) is not first["b"]  # read again; evicts a
    assert 1 not in cache and 2 in cache and 3 in cache
    weights = cache.get(b).modules[(0, "q_proj")]
    assert torch.equal(weights[1], torch.full((8, 2), 2.0))  # B with the scaling folded in
    with pytest.raises(ValueError, match="LoRA adapter id 1 is .*/a on this worker, not /elsewhere"):
        cache.get(LoRARequest("a", 1, "/elsewhere"))
