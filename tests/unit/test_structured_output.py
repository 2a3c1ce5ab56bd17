"""The engine's structured-output manager on the model's real tokenizer: the compiled-grammar cache
(hits, misses, eviction), waiting for a compile and its time bound, failures, and a matcher walked
token by token."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from services.common.config import GrammarLimits
from services.common.grammar import check_grammar
from services.common.model_files import resolve_tokenizer
from services.common.structured_outputs import StructuredOutputs
from services.engine.structured_output import GrammarError, StructuredOutputManager

VOCAB = 49152
EOS = (2,)
YES_NO = StructuredOutputs("choice", json.dumps(["yes", "no"]))
DIGITS = StructuredOutputs("regex", "[0-9]{2}")


@pytest.fixture(scope="module")
def model_path(tokenizer):  # the GGUF's tokenizer folder, extracted once into the cache
    return resolve_tokenizer("smollm2")


def manager(model_path, **kwargs) -> StructuredOutputManager:
    return StructuredOutputManager(model_path, VOCAB, **kwargs)


def wait_ready(m: StructuredOutputManager, request_id: str):
    m._pending[request_id].future.result(timeout=30)
    return m.ready(request_id)


def allowed(m: StructuredOutputManager, grammar) -> set[int]:
    words = np.frombuffer(m.bitmask([grammar]), dtype="<u4")
    return set(np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:VOCAB]).tolist())


def test_one_compile_per_constraint_and_eviction(model_path):
    m = manager(model_path, cache_size=2)
    compiles: list[float] = []
    m.compile_observers.append(compiles.append)
    m.submit("a", YES_NO, EOS)
    m.submit("b", YES_NO, EOS)  # the same constraint: a hit, even while it compiles
    assert wait_ready(m, "a") is not None and wait_ready(m, "b") is not None
    m.submit("c", DIGITS, EOS)
    m.submit("d", StructuredOutputs("json_object"), EOS)  # evicts YES_NO, the least recently used
    m.submit("e", YES_NO, EOS)
    assert (m.cache_hits, m.cache_misses) == (1, 4)
    for request_id in "cde":
        wait_ready(m, request_id)
    assert m.num_pending == 0 and len(compiles) == 4 and all(0 < s < 30 for s in compiles)
    m.shutdown()


def test_a_request_waits_for_its_compile_and_fails_past_the_time_bound(model_path):
    m = manager(model_path, compile_timeout=0.0, max_workers=1)
    release = threading.Event()
    m._pool.submit(release.wait)  # the pool's one thread is busy: the compile queues behind it
    try:
        m.submit("slow", DIGITS, EOS)
        with pytest.raises(GrammarError, match="did not compile within 0 s"):
            m.ready("slow")
        assert m.num_pending == 0
        m.compile_timeout = 60.0
        m.submit("waits", DIGITS, EOS)
        assert m.ready("waits") is None and m.num_pending == 1  # still compiling: wait
        m.forget("waits")  # aborted
        assert m.num_pending == 0
    finally:
        release.set()
        m.shutdown()


@pytest.mark.parametrize("constraint, why", [
    (StructuredOutputs("regex", "[0-9"), "unclosed character class"),
    (StructuredOutputs("json", '{"type": "nope"}'), "Invalid type"),
    (StructuredOutputs("grammar", "root ::= missing"), "not found"),
])
def test_a_bad_constraint_fails_its_request_and_is_not_cached(model_path, constraint, why):
    with pytest.raises(ValueError, match=why):  # the gateway and processor say so first
        check_grammar(constraint, GrammarLimits())
    m = manager(model_path)
    m.submit("bad", constraint, EOS)
    m._pending["bad"].future.exception(timeout=30)
    with pytest.raises(GrammarError, match=why):
        m.ready("bad")
    m.submit("again", constraint, EOS)  # a failure is compiled again, not served from the cache
    assert m.cache_misses == 2
    m.shutdown()


def test_a_matcher_walks_its_grammar_to_the_end(model_path, tokenizer):
    m = manager(model_path)
    m.submit("r", YES_NO, EOS)
    grammar = wait_ready(m, "r")
    first = allowed(m, grammar)
    texts = {tokenizer.decode([t]) for t in first}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    [yes] = tokenizer.encode("yes")
    assert yes in first
    assert grammar.accept([yes]) and grammar.is_complete
    assert allowed(m, grammar) == {EOS[0]}  # complete: only the end of the sequence may follow
    assert grammar.accept(EOS[:1])
    m.submit("t", YES_NO, EOS)  # a copy of the cached grammar: it starts from the beginning
    refused = wait_ready(m, "t")
    assert allowed(m, refused) == first
    assert not refused.accept(tokenizer.encode("maybe")[:1])
    m.shutdown()


def test_a_schema_with_properties_takes_no_other_key(model_path, tokenizer):
    # No additionalProperties in the schema, as in most tool definitions: compiled closed (xgrammar's
    # strict mode, vLLM's default), so a call cannot keep adding keys; a bare object stays open.
    weather = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
               "required": ["city", "unit"]}
    m = manager(model_path)

    def accepts(schema: dict, text: str) -> bool:
        m.submit(text, StructuredOutputs("json", json.dumps(schema)), EOS)
        grammar = wait_ready(m, text)
        return grammar.accept(tokenizer.encode(text)) and grammar.accept(EOS[:1])

    assert accepts(weather, '{"city":"Paris","unit":"c"}')
    assert not accepts(weather, '{"city":"Paris","unit":"c","unit_type":"c"}')
    assert not accepts(weather, '{"city":"Paris","city":"Rome","unit":"c"}')
    assert accepts({**weather, "additionalProperties": True}, '{"city":"Paris","unit":"c","unit_type":"c"}')
    assert accepts({"type": "object"}, '{"anything":[1,2]}')
    m.shutdown()


def test_drafts_are_cut_to_the_grammar_and_get_one_mask_row_each(model_path, tokenizer):
    """A draft sequence keeps its longest prefix the grammar accepts, short of the draft that
    completes it; mask row j of a drafting request is the grammar's state after its first j drafts,
    the same row a request that sampled those drafts would get; the matchers stay where they were."""
    m = manager(model_path)
    phrase = StructuredOutputs("regex", "The lighthouse keeper climbed")
    m.submit("drafting", phrase, EOS)
    m.submit("plain", YES_NO, EOS)
    drafting, plain = wait_ready(m, "drafting"), wait_ready(m, "plain")
    words = tokenizer.encode("The lighthouse keeper climbed the stairs")
    assert drafting.valid_drafts(words[:2] + [words[0]]) == words[:2]  # refused: " The" after " lighthouse"
    assert drafting.valid_drafts(words) == words[:3]  # " climbed" completes the grammar
    drafts = drafting.valid_drafts(words)
    rows = np.frombuffer(m.bitmask([plain, drafting], [[], drafts]), dtype="<u4").reshape(1 + len(drafts) + 1, -1)
    assert rows.tobytes()[: rows.shape[1] * 4] == m.bitmask([plain])
    stepped = []
    for token in [*drafts, None]:
        stepped.append(m.bitmask([drafting]))
        if token is not None:
            assert drafting.accept([token])
    assert [rows[1 + j].tobytes() for j in range(len(drafts) + 1)] == stepped
    assert drafting.accept(words[3:4]) and drafting.is_complete
    m.submit("again", phrase, EOS)
    fresh = wait_ready(m, "again")
    assert fresh.valid_drafts(words) == drafts  # the bitmask left the compiled grammar as it was
    m.shutdown()
