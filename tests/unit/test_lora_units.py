"""LoRA's small parts, state pinned after each call: the --lora-modules forms, the flags' rules, the
block hashes of adapters, the engine's step limit and registry, the worker's slots (LRU among the
adapters not in the step) and its host-memory cache (LRU)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.common.clients import EngineStats, LoRAState
from services.common.config import LoRAConfig
from services.common.errors import ModelNotFoundError
from services.common.flags import add_flags, build, to_argv
from services.common.hashing import hash_token_blocks
from services.common.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoRAModule, LoRARequest, parse_lora_module
from services.common.sampling_params import SamplingParams
from services.engine.lora_registry import LoRARegistry, LoRASlots, LoRAStepLimit
from services.engine.request import Request
from services.worker.lora.cpu_cache import AdapterCache
from services.processor.lora_affinity import adapter_candidates
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


def test_the_registry_loads_under_fresh_ids_and_removes_by_name() -> None:
    registry = LoRARegistry([LoRAModule("a", "/a"), LoRAModule("b", "/b")])
    assert registry.load("c", "/c") == LoRARequest("c", 3, "/c")
    with pytest.raises(ValueError, match="The lora adapter 'c' has already been loaded."):
        registry.load("c", "/elsewhere")
    assert registry.remove("c") == LoRARequest("c", 3, "/c")
    with pytest.raises(ModelNotFoundError, match="c"):
        registry.remove("c")
    # Its id is never given again: a worker knows id 3 by its folder until told it is gone.
    assert registry.load("c", "/c2") == LoRARequest("c", 4, "/c2")
    assert registry.names == ("a", "b", "c")


def test_the_engine_replays_the_workers_slots_and_frees_an_unloaded_adapters() -> None:
    worker, engine = SlotManager(2), LoRASlots(2)
    for step in ([2, 1], [3], [1, 3], [4]):
        held = worker.assign(sorted(step), lambda slot, lora_id: None)
        engine.step(step)
        assert set(engine.loaded) == set(held) | {i for i in worker.slot_ids if i is not None}
        assert sorted(engine.loaded) == sorted(i for i in worker.slot_ids if i is not None)
    assert worker.release(4) and not worker.release(4)
    engine.remove(4)
    assert worker.slot_ids.count(None) == 1 and 4 not in engine.loaded
    assert worker.assign([5], lambda slot, lora_id: None) == {5: worker.slot_ids.index(5)}
    assert worker.slot_ids.count(None) == 0  # the freed slot, not the other adapter's


def test_the_host_cache_forgets_an_unloaded_adapter(tmp_path: Path) -> None:
    save_tiny_adapter(tmp_path / "a")
    save_tiny_adapter(tmp_path / "b")
    cache = AdapterCache(2, 4, BASE)
    cache.get(LoRARequest("a", 1, str(tmp_path / "a")))
    cache.remove(1)
    assert 1 not in cache and len(cache) == 0
    cache.get(LoRARequest("a", 1, str(tmp_path / "b")))  # the id may come back with another folder
    assert 1 in cache


@dataclass
class Engine:
    """An EngineMember as the affinity reads it."""

    name: str
    stats: EngineStats | None = None
    in_flight: int = 0
    lora_in_flight: dict[str, int] = field(default_factory=dict)
    lora_routed: set[str] = field(default_factory=set)


def reported(running: int = 0, adapters: tuple[str, ...] = ("a", "b"), loaded: tuple[str, ...] = (),
             active: tuple[str, ...] = ()) -> EngineStats:
    return EngineStats(running, 0, 0, 100, 0, 0, 0, LoRAState(adapters, active, (), loaded, max_loras=1))


def names(engines: list[Engine]) -> list[str]:
    return [e.name for e in engines]


def test_adapter_affinity_prefers_the_engines_holding_it_until_load_says_otherwise() -> None:
    x, y, z = Engine("x", reported(loaded=("a",))), Engine("y", reported()), Engine("z", reported(active=("b",)))
    x.stats = reported(running=2, loaded=("a",))
    assert names(adapter_candidates([x, y, z], "a", max_imbalance=2)) == ["x"]  # 2 more than the idlest: within
    x.stats = reported(running=3, loaded=("a",))
    # Too busy: every engine serving it, for the policy to pick (by load, y).
    assert names(adapter_candidates([x, y, z], "a", max_imbalance=2)) == ["x", "y", "z"]
    # Nobody holds it: the engines with a slot to spare (z runs `b` in its only slot).
    assert names(adapter_candidates([y, z], "a", max_imbalance=2)) == ["y"]
    # What this processor sent since the last report counts as held; an engine not serving it is left out.
    z.lora_routed.add("a")
    assert names(adapter_candidates([y, z], "a", max_imbalance=2)) == ["z"]
    y.stats = reported(adapters=("b",))
    assert names(adapter_candidates([y, Engine("new")], "a", max_imbalance=2)) == ["new"]
