"""EngineCore and the offline LLM with the real model and worker: aborts at any moment, nothing
left behind, the sampling parameters a user notices."""

from __future__ import annotations

import dataclasses
import gc
import math

import pytest

from services import LLM, SamplingParams
from services.common.engine_output import EngineCoreRequest

KV_BYTES = 128 * 2**20


@pytest.fixture(scope="module")
def llm():
    # The default model as the CPU serves it, in its GGUF file's blocks (exact float32 arithmetic; the
    # same tokens as the converted folder: tests/model/test_hf_equivalence.py), a sixth of the
    # folder's float32 bytes a token: these tests are about the engine, not the weights' format.
    engine = LLM(model="smollm2", dtype="float32", quantization="gguf", kv_cache_memory=KV_BYTES,
                 max_num_batched_tokens=48)
    yield engine
    del engine
    gc.collect()


def assert_nothing_left(llm: LLM) -> None:
    llm.flush()
    manager = llm.engine.kv_cache_manager
    manager.check_integrity()
    llm.engine.check_integrity()
    assert manager.block_pool.get_num_free_blocks() == len(manager.block_pool.blocks)
    assert llm.worker.runner.batch.num_reqs == 0


def test_abort_at_any_moment_frees_blocks_and_worker_state(llm: LLM):
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    long_prompt = tokenizer.encode("A long story about the sea. " * 30)  # several 48-token chunks
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for rid in ("prefilling", "decoding", "waiting", "finishing"):
        engine.add_request(EngineCoreRequest(rid, long_prompt if rid == "prefilling" else [1, 2, 3, 4, 5],
                                             params, (2,)))
    engine.step()
    engine.abort_requests(["prefilling"])  # mid-prefill
    engine.step()
    engine.abort_requests(["decoding", "decoding", "never-existed"])  # mid-decode, twice, and unknown
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
        engine.check_integrity()
    engine.abort_requests(["finishing"])  # after completion: a no-op
    assert sorted(finished) == ["finishing", "waiting"]
    assert_nothing_left(llm)


def test_stop_strings_cut_the_text_and_abort_the_engine_request(llm: LLM):
    base = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert " 6" in base.text, base.text
    out = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=12, stop=[" 6"]))[0].outputs[0]
    assert out.text == base.text[: base.text.index(" 6")]
    assert out.finish_reason == "stop" and out.stop_reason == " 6"
    kept = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=12, stop=[" 6"],
                                                         include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == out.text + " 6"
    assert_nothing_left(llm)


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_max_tokens_eos_and_stop_token_ids(llm: LLM):
    chat = [{"role": "user", "content": "Say hello."}]
    natural = llm.chat(chat, SamplingParams(temperature=0, max_tokens=200))[0].outputs[0]
    assert natural.finish_reason == "stop" and natural.token_ids[-1] == 2  # <|im_end|>
    assert "<|im_end|>" not in natural.text
    ignored = llm.chat(chat, SamplingParams(temperature=0, max_tokens=len(natural.token_ids) + 3,
                                            ignore_eos=True))[0].outputs[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == len(natural.token_ids) + 3
    first = natural.token_ids[1]
    stopped = llm.chat(chat, SamplingParams(temperature=0, max_tokens=50, stop_token_ids=[first]))[0].outputs[0]
    assert stopped.token_ids == natural.token_ids[:2] and stopped.stop_reason == first
    held = llm.chat(chat, SamplingParams(temperature=0, max_tokens=50, min_tokens=len(natural.token_ids) + 2))
    assert len(held[0].outputs[0].token_ids) >= len(natural.token_ids) + 2


def test_logprobs_and_prompt_logprobs(llm: LLM):
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    out = llm.generate(["The capital of France is"], params)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 4
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        assert token_id in entry and entry[token_id].rank == 1  # greedy: the top token
        assert 3 <= len(entry) <= 4
    assert math.isclose(completion.cumulative_logprob,
                        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs)))
    prompt_ids = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt_ids)
    for token_id, entry in zip(prompt_ids[1:], out.prompt_logprobs[1:]):
        assert token_id in entry and entry[token_id].logprob <= 0
    assert out.num_cached_tokens == 0  # prompt logprobs need every position computed


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_n_choices_with_a_seed_differ_and_reproduce(llm: LLM):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12)
    first = llm.generate(["My favourite animal is"], params)[0]
    texts = [c.text for c in first.outputs]
    assert len(set(texts)) == 3, texts
    again = llm.generate(["My favourite animal is"], params)[0]
    assert [c.text for c in again.outputs] == texts
    assert_nothing_left(llm)


@pytest.mark.slow  # over a second: `make test`, not test-fast
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_request_resumed_from_its_outputs_goes_on_as_uninterrupted(llm: LLM, temperature: float):
    """What a migrated request is (services/processor/migration.py): prompt + the first k outputs,
    marked as outputs, with what is left of max_tokens and min_tokens; its other tokens are the same,
    penalties, min_tokens and the seeded draws included."""
    prompt = llm.get_tokenizer().encode("List some fruits, and say why you like each:")
    params = SamplingParams(temperature=temperature, seed=21, max_tokens=16, min_tokens=10, presence_penalty=0.5,
                            frequency_penalty=1.0, repetition_penalty=1.1)
    whole = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert len(whole) == 16
    for k in (3, 12):
        resumed = dataclasses.replace(params, max_tokens=16 - k, min_tokens=max(0, 10 - k), num_resumed_outputs=k)
        rest = llm.generate([prompt + whole[:k]], resumed)[0].outputs[0].token_ids
        assert whole[:k] + rest == whole, k
    assert_nothing_left(llm)


def test_prompt_too_long_and_empty_are_clear_errors(llm: LLM):
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([[5] * llm.engine.max_model_len], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate([[10**7]], SamplingParams(max_tokens=1))
    assert_nothing_left(llm)
