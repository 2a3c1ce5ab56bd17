"""Structured outputs in the engine with the real model and worker: a batch mixing
constrained and unconstrained requests leaves the unconstrained ones exactly their solo tokens;
constrained requests survive preemption; aborts at any stage, and a constraint the engine cannot
compile, leave nothing behind."""

from __future__ import annotations

import gc
import json
import time

import jsonschema
import numpy as np
import pytest

from loadtests.json_schemas import JSON_SCHEMAS
from services import LLM, SamplingParams
from services.common.engine_output import EngineCoreRequest
from services.common.structured_outputs import StructuredOutputs

pytestmark = pytest.mark.slow  # loads the model: `make test`, not test-fast

SCHEMAS = dict(JSON_SCHEMAS)
PLAIN = ["The capital of France is", "Write a haiku about rain.", "1, 2, 3, 4,", "Tell me about dogs."]
CONSTRAINED = [
    ("person", SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputs(
        "json", json.dumps(SCHEMAS["person"])))),
    ("ref", SamplingParams(temperature=0.8, seed=3, max_tokens=60, logprobs=3, structured_outputs=StructuredOutputs(
        "json", json.dumps(SCHEMAS["ref"])))),
    ("regex", SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputs("regex", "[a-c]{4}"))),
    ("choice", SamplingParams(temperature=0, max_tokens=20, logprobs=2, structured_outputs=StructuredOutputs(
        "choice", json.dumps(["apple", "banana"])))),
]
PLAIN_PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def check_constrained(name: str, text: str) -> None:
    if name in SCHEMAS:
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    elif name == "regex":
        assert len(text) == 4 and set(text) <= set("abc"), text
    else:
        assert text in ("apple", "banana"), text


def assert_nothing_left(llm: LLM) -> None:
    llm.flush()
    manager = llm.engine.kv_cache_manager
    llm.engine.check_integrity()
    assert manager.block_pool.get_num_free_blocks() == len(manager.block_pool.blocks)
    assert llm.worker.runner.batch.num_reqs == 0
    assert llm.engine.structured_output.num_pending == 0 and not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def llm():
    engine = LLM(model="smollm2", dtype="float32", quantization="gguf", kv_cache_memory=64 * 2**20, max_model_len=512)
    yield engine
    del engine
    gc.collect()


def test_mixed_batch_gives_unconstrained_requests_their_solo_tokens(llm: LLM):
    solo = [llm.generate([p], PLAIN_PARAMS)[0].outputs[0].token_ids for p in PLAIN]
    prompts = [p for pair in zip(PLAIN, [f"Answer as {n}:" for n, _ in CONSTRAINED]) for p in pair]
    params = [p for pair in zip([PLAIN_PARAMS] * 4, [c for _, c in CONSTRAINED]) for p in pair]
    outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in outputs[0::2]] == solo
    for (name, params), out in zip(CONSTRAINED, outputs[1::2]):
        assert out.finish_reason == "stop", (name, out.text)
        check_constrained(name, out.text)
    # The mask comes before logprobs (as vLLM's): a token the choice forbids has a logprob of -inf.
    tokenizer = llm.get_tokenizer()
    choice = outputs[-1]
    for i, logprobs in enumerate(choice.logprobs):
        before = tokenizer.decode(choice.token_ids[:i])
        for token_id, lp in logprobs.items():
            fits = token_id == 2 or any(c.startswith(before + tokenizer.decode([token_id])) for c in ("apple", "banana"))
            assert fits or lp.logprob == float("-inf"), (before, token_id, lp)
        assert logprobs[choice.token_ids[i]].logprob > float("-inf")
    assert_nothing_left(llm)


def test_constrained_requests_survive_preemption():
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4  # layers, block size, kv heads, head size, fp32
    llm = LLM(model="smollm2", dtype="float32", quantization="gguf", kv_cache_memory=14 * block_bytes,
              max_model_len=512)
    try:
        prompts = [f"Answer as {n}, request {i}:" for i in range(3) for n, _ in CONSTRAINED] + PLAIN
        params = [c for _ in range(3) for _, c in CONSTRAINED] + [PLAIN_PARAMS] * len(PLAIN)
        outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert llm.engine.stats().num_preemptions > 0, "the small KV cache should have forced preemption"
        for (name, _), out in zip([c for _ in range(3) for c in CONSTRAINED], outputs):
            check_constrained(name, out.text)
        assert_nothing_left(llm)
    finally:
        del llm
        gc.collect()


def test_aborts_and_failed_compiles_leave_nothing(llm: LLM):
    engine = llm.engine
    prompt = llm.get_tokenizer().encode("Some JSON:")
    json_params = CONSTRAINED[0][1]
    engine.add_request(EngineCoreRequest("pending", prompt, json_params, (2,)))
    engine.abort_requests(["pending"])  # before its grammar compiled
    engine.add_request(EngineCoreRequest("decoding", prompt, json_params, (2,)))
    # A constraint the processor would have refused: the engine trusts no caller, the request fails alone.
    engine.add_request(EngineCoreRequest("bad", prompt, SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputs("regex", "[0-9")), (2,)))
    outputs = []
    while not (any(o.request_id == "bad" for o in outputs)
               and any(o.request_id == "decoding" and o.new_token_ids for o in outputs)):
        outputs += engine.step()
    [bad] = [o for o in outputs if o.request_id == "bad"]
    assert bad.finish_reason == "error" and "unclosed character class" in bad.error
    engine.step()
    engine.abort_requests(["decoding"])  # mid-decode
    assert_nothing_left(llm)


def test_a_complete_grammar_ends_its_request_whatever_min_tokens_and_ignore_eos_say(llm: LLM):
    choice = StructuredOutputs("choice", json.dumps(["apple", "banana"]))
    for extra in ({}, {"min_tokens": 8}, {"ignore_eos": True}):
        out = llm.generate(["Fruit:"], SamplingParams(temperature=0, max_tokens=20, structured_outputs=choice,
                                                      **extra))[0].outputs[0]
        # Ended at once: no EOS sampled (min_tokens would have masked it), no token past the grammar.
        assert (out.text, out.finish_reason) in (("apple", "stop"), ("banana", "stop")), (extra, out)
        assert llm.get_tokenizer().decode(out.token_ids) == out.text
    assert_nothing_left(llm)


def test_a_constraint_changes_the_output_only_where_it_forbids_the_models_choice(llm: LLM, hf_reference):
    """Greedy under a JSON schema: at every position the token is the model's own argmax (Hugging
    Face's, given the same prefix) unless the grammar forbids that argmax there (or the two are a
    float near-tie). And a constraint that forbids nothing the model writes changes nothing."""
    prompt = llm.get_tokenizer().encode("A person as JSON:")
    constraint = StructuredOutputs("json", json.dumps(SCHEMAS["person"]))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint))[0]
    tokens = list(out.outputs[0].token_ids)
    reference = hf_reference(prompt, tokens)
    manager = llm.engine.structured_output
    manager.submit("probe", constraint, [2])
    while (grammar := manager.ready("probe")) is None:
        time.sleep(0.01)
    changed = 0
    for i, (ours, theirs) in enumerate(zip(tokens, reference.token_ids)):
        if ours != theirs:
            row = np.frombuffer(manager.bitmask([grammar]), dtype=np.uint32)
            allowed = bool(row[theirs // 32] >> (theirs % 32) & 1)
            near_tie = abs(float(reference.logprobs[i, theirs] - reference.logprobs[i, ours])) < 1e-3
            assert not allowed or near_tie, f"position {i}: the grammar allows {theirs}, yet {ours} was chosen"
            changed += not allowed
        assert grammar.accept([ours]), f"position {i}: the grammar refuses the token it let through"
    assert changed > 0, "the schema changed nothing: this test would not notice a mask that did nothing"

    plain = SamplingParams(temperature=0, max_tokens=24)  # EOS ends both (a grammar's EOS always ends it)
    anything = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputs("regex", r"[\s\S]*"))
    for text in PLAIN:
        free, open_ = llm.generate([text, text], [plain, anything])
        assert open_.outputs[0].token_ids == free.outputs[0].token_ids, text
    assert_nothing_left(llm)
