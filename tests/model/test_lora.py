"""LoRA adapters through `LLM(enable_lora=True)` on tiny family models (tests/model/families.py), against
Hugging Face transformers + PEFT with the same adapter (tests/model/lora_adapters.py):

  - each adapter alone gives PEFT's greedy tokens, top-5 logprobs within 1e-3 (a Llama, Gemma 3);
  - two adapters and the base model in one batch give each request's tokens alone;
  - over GGUF-style blocks (`quantization="int8"`) LoRA runs in the native decoder, bit for bit the
    LoRA layers' modules, in a mixed batch of chunks and decodes, with float32 adapters and with the
    bfloat16 ones of `--dtype auto`;
  - under `--dtype float16` an adapter agrees with PEFT in float16 (tests/model/test_dtype_float16.py's
    bounds), through the torch LoRA path: the native LoRA kernels take float32 and bfloat16;
  - the prefix cache never crosses adapters: the same prompt under another adapter hits nothing,
    under the same adapter it hits its full blocks, and the pool holds one chain per adapter;
  - with one adapter slot, requests of three adapters all finish with their own tokens, and a waiting
    adapter is not overtaken by later requests of the adapter that holds the slot;
  - at tensor-parallel size 2 an adapter gives the tokens of size 1;
  - a folder that does not fit is refused, naming what is wrong.
"""

from __future__ import annotations

import copy
import gc
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services import LLM, SamplingParams
from services.common.hashing import hash_token_blocks
from services.common.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from services.llm import LoRARequest
from services.worker.native_decoder import NativeDecoder
from tests.model.families import BLOCK_SIZE, GREEDY, Family, Scenario, check_greedy, random_prompts
from tests.model.hf_reference import HFReference, agreement
from tests.model.test_dtype_float16 import assert_float16_agreement
from tests.model.lora_adapters import Adapter, save_adapter

MAX_RANK = 8
KV_BLOCKS = 64
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def make_llm(family: Family, **kwargs) -> LLM:
    kwargs = {"max_loras": 2, "dtype": "float32", **kwargs}
    return LLM(model=str(family.path), enable_lora=True, max_lora_rank=MAX_RANK,
               kv_cache_memory=KV_BLOCKS * family.block_bytes, **kwargs)


def adapters_of(family: Family, folder: Path) -> dict[str, Adapter]:
    """Three adapters of two ranks: `a` on every module (rsLoRA), `b` on q, v and down only, `c` rank 2."""
    return {
        "a": save_adapter(family.path, folder / "a", "a", 1, rank=4, use_rslora=True, seed=1),
        "b": save_adapter(family.path, folder / "b", "b", 2, rank=MAX_RANK,
                          targets=("q_proj", "v_proj", "down_proj"), seed=2),
        "c": save_adapter(family.path, folder / "c", "c", 3, rank=2, seed=3),
    }


@pytest.fixture(scope="module")
def llama(model_families: dict[str, Family]) -> Family:
    return model_families["llama-untied"]


@pytest.fixture(scope="module")
def adapters(llama: Family, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Adapter]:
    return adapters_of(llama, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def llm(llama: Family) -> Iterator[LLM]:
    llm = make_llm(llama)
    yield llm
    del llm
    gc.collect()


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_each_adapter_alone_gives_peft_tokens_and_logprobs(llm: LLM, adapters: dict[str, Adapter]) -> None:
    prompts = random_prompts((5, BLOCK_SIZE + 1, 40), seed=3)
    base = tokens(llm.generate(prompts, GREEDY))
    for adapter in (adapters["a"], adapters["b"]):
        outputs = llm.generate(prompts, GREEDY, lora_request=adapter.request)
        assert check_greedy(Scenario(prompts, outputs), adapter.reference) <= 1, adapter.name
        assert tokens(outputs) != base, f"adapter {adapter.name} changed nothing"
    llm.engine.check_integrity()


@pytest.mark.slow  # over a second: `make test`, not test-fast
@pytest.mark.parametrize("name", ["llama-tied", "gemma3"])
def test_an_adapter_of_a_tied_llama_and_of_gemma3_gives_peft_tokens(
        model_families: dict[str, Family], name: str, tmp_path: Path) -> None:
    family = model_families[name]
    adapter = save_adapter(family.path, tmp_path / "a", "a", 1, rank=4, seed=4)
    prompts = random_prompts((7, 33), seed=4)
    llm = make_llm(family)
    try:
        outputs = llm.generate(prompts, GREEDY, lora_request=adapter.request)
    finally:
        del llm
        gc.collect()
    assert check_greedy(Scenario(prompts, outputs), adapter.reference) <= 1


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_an_adapter_in_float16_agrees_with_peft_in_float16(llama: Family, adapters: dict[str, Adapter]) -> None:
    adapter = adapters["a"]
    prompts = random_prompts((5, BLOCK_SIZE + 1, 40), seed=3)
    llm = make_llm(llama, dtype="half")
    try:
        assert {layer.a_stack.dtype for layer in llm.worker.lora.layers[0].values()} == {torch.float16}
        outputs = llm.generate(prompts, GREEDY, lora_request=adapter.request)
    finally:
        del llm
        gc.collect()
    scored = agreement(HFReference(copy.deepcopy(adapter.reference.hf_model).to(torch.float16)), prompts, outputs)
    print(f"adapter a in float16: {scored.summary()}")
    assert_float16_agreement(scored)


def test_two_adapters_and_the_base_in_one_batch_give_each_request_its_tokens_alone(
        llm: LLM, adapters: dict[str, Adapter]) -> None:
    a, b = adapters["a"].request, adapters["b"].request
    prompts = random_prompts((9, 20, 3, 35, 17), seed=5)
    loras = [a, b, None, a, b]
    alone = [tokens(llm.generate([p], SHORT, lora_request=lora))[0] for p, lora in zip(prompts, loras)]
    assert tokens(llm.generate(prompts, SHORT, lora_request=loras)) == alone
    assert sorted(llm.worker.lora.slots.slot_ids) == [1, 2]  # both adapters ran, one slot each
    assert len({tuple(t) for t in alone[:3]}) == 3


@pytest.mark.slow  # over a second: `make test`, not test-fast
@pytest.mark.parametrize(("dtype", "slots"), [("float32", torch.float32), ("auto", torch.bfloat16)])
def test_lora_runs_in_the_native_decoder_bit_for_bit_as_its_layers(llama: Family, adapters: dict[str, Adapter],
                                                                    dtype: str, slots: torch.dtype) -> None:
    llm = make_llm(llama, quantization="int8", max_num_batched_tokens=24, dtype=dtype)
    try:
        # `--dtype auto` keeps the adapters in bfloat16 (half the bytes a step reads), float32 keeps float32.
        assert {layer.a_stack.dtype for layer in llm.worker.lora.layers[0].values()} == {slots}
        model = llm.worker.runner.model.model
        served = model.native_decoder
        assert isinstance(served, NativeDecoder)  # LoRA no longer sends the model through its modules
        calls = []
        counting = NativeDecoder(model, served.ops)
        counting.forward = lambda hidden, cos_sin: calls.append(hidden.shape[0]) or served.forward(hidden, cos_sin)
        prompts = random_prompts((9, 20, 3, 35, 17), seed=8)
        loras = [adapters["a"].request, adapters["b"].request, None, adapters["a"].request, adapters["b"].request]
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
        runs = []
        for native in (counting, None):
            model.native_decoder = native
            llm.engine.reset_prefix_cache()  # the same steps twice: no chunk read from the first run's cache
            runs.append(llm.generate(prompts, params, lora_request=loras))
        assert calls and max(calls) > 5 and 1 in calls  # chunks beside decodes, and a lone decode
        for ours, modules in zip(*runs):
            assert ours.outputs[0].token_ids == modules.outputs[0].token_ids
            assert ours.outputs[0].logprobs == modules.outputs[0].logprobs  # equal to the last bit
        assert len({tuple(o.outputs[0].token_ids) for o in runs[0][:3]}) == 3  # the adapters count
    finally:
        del llm
        gc.collect()


def test_the_prefix_cache_never_crosses_adapters(llm: LLM, adapters: dict[str, Adapter]) -> None:
    llm.engine.reset_prefix_cache()
    prompt = random_prompts((2 * BLOCK_SIZE + 8,), seed=6)[0]
    a, b = adapters["a"].request, adapters["b"].request
    runs = [(a, 0), (b, 0), (a, 2 * BLOCK_SIZE), (None, 0), (None, 2 * BLOCK_SIZE), (b, 2 * BLOCK_SIZE)]
    outputs = {}
    for lora, cached in runs:
        out = llm.generate([prompt], SHORT, lora_request=lora)[0]
        assert out.num_cached_tokens == cached, (lora, out.num_cached_tokens)
        outputs.setdefault(lora, []).append(out.outputs[0].token_ids)
    assert all(first == again for first, again in outputs.values())  # a hit computes what a miss did
    # One chain of two full blocks per adapter (and the base), each named by its adapter; all free.
    pool = llm.engine.kv_cache_manager.block_pool
    model_id = llm.engine.model_id
    chains = [hash_token_blocks(prompt, BLOCK_SIZE, model_id, lora_name=name) for name in (None, "a", "b")]
    assert set(pool.cached_block_hashes()) == {h for chain in chains for h in chain}
    assert len(set(pool.cached_block_hashes())) == 6
    assert pool.get_num_free_blocks() == pool.num_blocks
    llm.engine.check_integrity()


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_one_slot_serves_three_adapters_without_starving_any(llama: Family, adapters: dict[str, Adapter]) -> None:
    llm = make_llm(llama, max_loras=1)
    try:
        a, b, c = (adapters[n].request for n in "abc")
        prompts = random_prompts((6, 19, 11, 25, 8, 14), seed=7)
        loras = [a, b, c, a, b, c]
        alone = [tokens(llm.generate([p], SHORT, lora_request=lora))[0] for p, lora in zip(prompts, loras)]
        assert tokens(llm.generate(prompts, SHORT, lora_request=loras)) == alone
        assert llm.worker.lora.slots.slot_ids in ([1], [2], [3])

        # `a` holds the slot; `b` waits; a later `a` request must not overtake it.
        first_token_step = run_in_order(llm, [("a1", a, 6), ("b1", b, 2), ("a2", a, 2)], prompts[0])
        assert first_token_step["a1"] < first_token_step["b1"] < first_token_step["a2"]
        llm.engine.check_integrity()
        assert llm.engine.kv_cache_manager.block_pool.get_num_free_blocks() == \
            llm.engine.kv_cache_manager.block_pool.num_blocks
    finally:
        del llm
        gc.collect()


def run_in_order(llm: LLM, requests: list[tuple[str, LoRARequest, int]], prompt: list[int]) -> dict[str, int]:
    """Adds the first request, steps once, adds the others; steps until all finish. The step at which
    each request got its first token."""
    first: dict[str, int] = {}
    engine_requests = []
    for request_id, lora, max_tokens in requests:
        llm.engine.loras.add(lora)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine_requests += llm.processor.make_requests(request_id, prompt, params, lora_name=lora.lora_name)
    llm.engine.add_request(engine_requests[0])
    for step in range(100):
        if step == 1:
            for request in engine_requests[1:]:
                llm.engine.add_request(request)
        for out in llm.engine.step():
            first.setdefault(out.request_id, step)
        if step >= 1 and not llm.engine.has_unfinished_requests():
            break
    llm.flush()
    assert set(first) == {r for r, _, _ in requests}, first
    return first


def test_an_unknown_adapter_or_a_bad_folder_is_refused(llm: LLM, llama: Family, adapters: dict[str, Adapter],
                                                        tmp_path: Path) -> None:
    prompt = random_prompts((5,), seed=8)[0]
    llm.engine.loras.add(adapters["a"].request)
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'; this engine serves: (.*, )?a\\b"):
        llm.engine.check_request(llm.processor.make_requests("x", prompt, SHORT, lora_name="nope")[0])
    llm.worker.lora.add(adapters["a"].request)  # id 1 is `a`'s folder; another folder under it is refused
    with pytest.raises(ValueError, match="LoRA adapter id 1 is .* on this worker"):
        llm.worker.lora.add(LoRARequest("a-elsewhere", 1, str(tmp_path)))
    # A tensor of the wrong shape, and a rank over the limit: refused as the LLM starts.
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(adapters["a"].path / ADAPTER_CONFIG, bad / ADAPTER_CONFIG)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4)},
              bad / ADAPTER_WEIGHTS)
    for module, problem in ((f"bad={bad}", r"q_proj.lora_A.weight has shape \[4, 32\], the base model expects "
                                           r"\[4, 64\]"),
                            (adapters["b"].module, "has rank 8, over --max-lora-rank 4")):
        with pytest.raises(ValueError, match=problem):
            LLM(model=str(llama.path), dtype="float32", enable_lora=True, max_lora_rank=4, lora_modules=[module],
                kv_cache_memory=KV_BLOCKS * llama.block_bytes)


def test_an_adapter_loaded_at_run_time_runs_and_leaves_nothing_once_unloaded(
        llm: LLM, adapters: dict[str, Adapter]) -> None:
    """vLLM's load / unload: the engine registers the folder under a fresh id; unloaded while its
    request runs, the request finishes with it, then the worker drops its slot, host memory and id."""
    prompt = random_prompts((9,), seed=31)[0]
    expected = tokens(llm.generate([prompt], SHORT, lora_request=adapters["c"].request))[0]
    live = llm.engine.add_lora("live", str(adapters["c"].path))
    assert live.lora_int_id not in {a.lora_int_id for a in adapters.values()}
    request = llm.processor.make_requests("live-0", prompt, SHORT, lora_name="live")[0]
    llm.engine.add_request(request)
    got = [t for o in llm.engine.step() for t in o.new_token_ids]
    assert live.lora_int_id in llm.worker.lora.slots.slot_ids and "live" in llm.engine.lora_state.loaded
    llm.engine.remove_lora("live")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'live'"):
        llm.engine.check_request(llm.processor.make_requests("live-1", prompt, SHORT, lora_name="live")[0])
    for _ in range(2 * SHORT.max_tokens):  # bounded: the request has max_tokens - 1 steps left
        if not (llm.engine.has_unfinished_requests() or llm.engine.has_removed_loras()):
            break
        got += [t for o in llm.engine.step() for t in o.new_token_ids]
    assert got == expected
    lora = llm.worker.lora
    assert live.lora_int_id not in lora.slots.slot_ids and live.lora_int_id not in lora.cache
    assert live.lora_int_id not in lora._requests and live.lora_int_id not in llm.engine.lora_slots.loaded
    assert "live" not in llm.engine.lora_state.adapters and "live" not in llm.engine.lora_state.loaded
    llm.engine.check_integrity()


@pytest.mark.slow  # a torch.distributed group of two worker processes
def test_tensor_parallel_2_gives_the_tokens_of_size_1(llm: LLM, llama: Family, adapters: dict[str, Adapter]) -> None:
    prompts = random_prompts((9, 30), seed=9)
    loras = [adapters["a"].request, adapters["b"].request]  # every module (rsLoRA); some of them at rank 8
    expected = [llm.generate(prompts, GREEDY, lora_request=lora) for lora in loras]
    with make_llm(llama, tensor_parallel_size=2) as tp:
        got = [tp.generate(prompts, GREEDY, lora_request=lora) for lora in loras]
        tp.engine.check_integrity()
    for lora, ours_all, theirs_all in zip(loras, got, expected):
        assert tokens(ours_all) == tokens(theirs_all), lora.lora_name
        for ours, theirs in zip(ours_all, theirs_all):
            for top, ref in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
                assert top.keys() == ref.keys()
                assert all(abs(top[t].logprob - ref[t].logprob) < 1e-3 for t in top)
