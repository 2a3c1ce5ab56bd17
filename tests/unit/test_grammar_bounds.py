"""What a constraint may hold and cost (services/common/grammar.py, GrammarLimits): each bound refuses
one over it and passes one at it, naming its flag; nothing deep or huge reaches a parser that
recurses or a compile; a choice list validates in linear time; the engine refuses what is over a
bound without compiling it, and one slow compile does not hold back another's."""

from __future__ import annotations

import json
import threading
import time

import pytest

from services.common.config import GrammarLimits
from services.common.grammar import ConstraintTooLarge, check_bounds, check_grammar, json_depth
from services.common.model_files import resolve_tokenizer
from services.common.structured_outputs import StructuredOutputs
from services.engine.structured_output import GrammarError, StructuredOutputManager

VOCAB = 49152
EOS = (2,)
SMALL = GrammarLimits(max_constraint_bytes=64, max_constraint_choices=3, max_constraint_depth=3,
                      max_regex_length=8, max_grammar_rules=2)


def choices(n: int) -> StructuredOutputs:
    return StructuredOutputs("choice", json.dumps([f"c{i}" for i in range(n)]))


def padded(size: int) -> StructuredOutputs:
    """A JSON schema of exactly `size` bytes."""
    return StructuredOutputs("json", json.dumps({"enum": ["a" * (size - len(json.dumps({"enum": [""]})))]}))


@pytest.mark.parametrize("at, over, flag", [
    (choices(3), choices(4), "--max-constraint-choices"),
    (StructuredOutputs("json", '{"a":{"b":{}}}'), StructuredOutputs("json", '{"a":{"b":{"c":[]}}}'),
     "--max-constraint-depth"),
    (StructuredOutputs("regex", "[0-9]{2}"), StructuredOutputs("regex", "[0-9]{2}x"), "--max-regex-length"),
    (StructuredOutputs("grammar", 'start: a\na: "x"'), StructuredOutputs("grammar", 'start: a\na: b\nb: "x"'),
     "--max-grammar-rules"),
    (StructuredOutputs("grammar", 'root ::= a\na ::= "x"'),
     StructuredOutputs("grammar", 'root ::= a\na ::= b\nb ::= "x"'), "--max-grammar-rules"),
    (padded(64), padded(65), "--max-constraint-bytes"),
])
def test_each_bound_refuses_one_over_it_naming_its_flag(at, over, flag):
    check_bounds(at, SMALL)
    with pytest.raises(ConstraintTooLarge, match=f"over this server's limit of .* \\({flag}\\)"):
        check_bounds(over, SMALL)
    with pytest.raises(ValueError, match=f"invalid {over.kind}: .*\\({flag}\\)"):
        check_grammar(over, SMALL)  # the processor's check: the bound before any parse


def test_nesting_is_counted_without_parsing_and_strings_do_not_nest():
    assert json_depth('{"a": [1, {"b": "[[[{{{"}], "c": "\\"]]"}') == 3
    assert json_depth("[" * 100_000) == 100_000  # Python's json module would raise RecursionError
    deep = StructuredOutputs("json", "[" * 50_000 + "]" * 50_000)  # 100 kB: under the default byte bound
    for limits in (GrammarLimits(), GrammarLimits(max_constraint_bytes=2**30)):
        with pytest.raises(ValueError, match="50000 levels of nesting, over .* of 64 \\(--max-constraint-depth\\)"):
            check_grammar(deep, limits)


def test_a_choice_bomb_is_refused_in_linear_time():
    bomb = StructuredOutputs("choice", json.dumps([f"choice number {i}" for i in range(150_000)]))  # 3.5 MB
    start = time.perf_counter()
    with pytest.raises(ValueError, match="--max-constraint-bytes"):
        check_grammar(bomb, GrammarLimits())
    assert time.perf_counter() - start < 0.5


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_choice_validation_grows_linearly():
    """A rule of one alternative per choice took quadratic time to validate (30k: 1 s, 150k: 35 s)."""
    unbounded = GrammarLimits(max_constraint_bytes=2**30, max_constraint_choices=10**9)

    def seconds(n: int) -> float:
        constraint = StructuredOutputs("choice", json.dumps([f"choice number {i}" for i in range(n)]))
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            check_grammar(constraint, unbounded)
            best = min(best, time.perf_counter() - start)
        return best

    small, large = seconds(4_000), seconds(32_000)  # 8 times the choices: ~8 times the time, not ~60
    assert large < 20 * small + 0.05, f"4k choices {small:.3f} s, 32k {large:.3f} s"


def test_a_choice_list_keeps_its_language():
    constraint = StructuredOutputs("choice", json.dumps(["a", "ab", 'say "hi"\n']))
    check_grammar(constraint, GrammarLimits())


@pytest.fixture(scope="module")
def model_path(tokenizer):  # the GGUF's tokenizer folder, extracted once into the cache
    return resolve_tokenizer("smollm2")


def test_the_engine_refuses_a_constraint_over_a_bound_without_compiling_it(model_path):
    m = StructuredOutputManager(model_path, VOCAB, limits=SMALL)
    compiles: list[float] = []
    m.compile_observers.append(compiles.append)
    m.submit("bomb", choices(4), EOS)
    m._pending["bomb"].future.exception(timeout=30)
    with pytest.raises(GrammarError, match="4 choices, over this server's limit of 3"):
        m.ready("bomb")
    assert compiles == [] and m.num_pending == 0
    m.shutdown()


def test_a_slow_compile_does_not_hold_back_another(model_path):
    m = StructuredOutputManager(model_path, VOCAB)  # the default threads
    release = threading.Event()
    m._pool.submit(release.wait)  # a compile that takes as long as the test wants
    try:
        m.submit("quick", StructuredOutputs("regex", "[0-9]{2}"), EOS)
        deadline = time.monotonic() + 30
        while m.ready("quick") is None:
            assert time.monotonic() < deadline, "a compile waited behind a slow one"
            time.sleep(0.01)
    finally:
        release.set()
        m.shutdown()
