"""Stop strings (StopStringMatcher) and one choice's output state (detokenizer + stop strings)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.sampling_params import SamplingParams
from services.processor.output_processor import RequestOutputState, TextDelta
from services.processor.stop_checker import StopStringMatcher


def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> list[str]:
    """Feeds deltas until a stop; returns what was emitted per call, the flush last if no stop."""
    out = []
    for delta in deltas:
        text, stopped = matcher.feed(delta)
        out.append(text)
        if stopped:
            return out
    out.append(matcher.flush())
    return out


def reference(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """The whole text cut at the stop string that completes first (ties: the longer one)."""
    matches = [(text.find(s) + len(s), text.find(s), s) for s in stop if s in text]
    if not matches:
        return text, None
    end, start, s = min(matches)
    return text[:end if include else start], s


# --- StopStringMatcher ------------------------------------------------------------------------------


def test_stop_spanning_deltas():
    m = StopStringMatcher(["lo W"], include_stop_str_in_output=False)
    # Holdback is len("lo W") - 1 = 3 characters.
    assert m.feed("Hel") == ("", False)
    assert m.feed("lo Wo") == ("Hel", True)
    assert m.stop_reason == "lo W"
    assert m.feed("rld") == ("", True)  # nothing after a stop


def test_stop_spanning_deltas_included():
    m = StopStringMatcher(["lo W"], include_stop_str_in_output=True)
    assert feed_all(m, ["Hel", "lo Wo", "rld"]) == ["", "Hello W"]
    assert m.stop_reason == "lo W"


def test_no_stop_holds_back_then_flushes():
    m = StopStringMatcher(["lo W"])
    assert m.feed("Hel") == ("", False)
    assert m.feed("lo there") == ("Hello th", False)
    assert m.feed("!") == ("e", False)
    assert m.flush() == "re!"
    assert m.stop_reason is None and not m.stopped


def test_partial_match_is_held_until_disambiguated():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc S") == ("ab", False)
    assert m.feed("T") == ("c", False)  # " ST" could still become "STOP"
    assert m.feed("O") == (" ", False)  # "STO"
    assert m.feed("p") == ("S", False)  # "STOp": not a stop; "TOp" still held (fixed holdback)
    assert m.flush() == "TOp"


def test_earliest_completed_stop_wins():
    # Both complete in one delta: "bc" ends first, so a char-by-char stream would stop there too.
    m = StopStringMatcher(["abcd", "bc"])
    assert feed_all(m, ["xabcdy"]) == ["xa"]
    assert m.stop_reason == "bc"
    # Same end: the longer (earlier-starting) one.
    m = StopStringMatcher(["bc", "abc"])
    assert feed_all(m, ["xabcy"]) == ["x"]
    assert m.stop_reason == "abc"
    # List order does not matter.
    m = StopStringMatcher(["zz", "b"], include_stop_str_in_output=True)
    assert feed_all(m, ["abzz"]) == ["ab"]
    assert m.stop_reason == "b"


def test_stops_of_different_lengths():
    m = StopStringMatcher(["\n\n", "Observation:", "END"])
    assert m._holdback == len("Observation:") - 1
    deltas = ["Thought: x", "\nObserv", "ation: 42", "\n\nmore"]
    assert "".join(feed_all(m, deltas)) == "Thought: x\n"
    assert m.stop_reason == "Observation:"


def test_stop_at_the_very_start():
    m = StopStringMatcher(["<"], include_stop_str_in_output=False)
    assert m.feed("<tag>") == ("", True)
    assert m.stop_reason == "<"
    m = StopStringMatcher(["Hi"], include_stop_str_in_output=True)
    assert m.feed("H") == ("", False)
    assert m.feed("i there") == ("Hi", True)


def test_no_stops_passes_through():
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""


def test_unchecked_text_is_held_back_and_checked_later():
    # check=False (before min_tokens): no match is made in that text, but it is still held back so
    # that a stop ending in a later, checked delta is found.
    m = StopStringMatcher(["abc"])
    assert m.feed("xab", check=False) == ("x", False)
    assert m.feed("c", check=True) == ("", True)
    # A stop wholly inside unchecked text never matches (vLLM: only text after min_tokens counts).
    m = StopStringMatcher(["ab"])
    assert m.feed("xab", check=False) == ("xa", False)
    assert m.feed("c") == ("b", False)
    assert m.flush() == "c"


def test_bad_stops_rejected():
    with pytest.raises(ValueError):
        StopStringMatcher(["a", ""])
    with pytest.raises(TypeError):
        StopStringMatcher("abc")  # type: ignore[arg-type]


@pytest.mark.slow  # over a second: `make test`, not test-fast
@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc ", max_size=30),
    stop=st.lists(st.text(alphabet="abc ", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=10),
)
def test_any_chunking_gives_the_reference_cut(text, stop, include, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    m = StopStringMatcher(stop, include)
    holdback = max(map(len, stop)) - 1
    emitted, fed = "", ""
    for delta in deltas:
        fed += delta
        out, stopped = m.feed(delta)
        emitted += out
        if stopped:
            break
        # Exactly the fixed holdback is kept back while streaming.
        assert emitted == fed[:max(0, len(fed) - holdback)]
    else:
        emitted += m.flush()
    assert (emitted, m.stop_reason) == reference(text, stop, include)


# --- RequestOutputState: detokenizer + stop strings for one choice -----------------------------------


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def run(state: RequestOutputState, ids: list[int], chunk: int, finish_reason: str = "length",
        drop_last_token: bool = False) -> list[TextDelta]:
    """Feeds `ids` `chunk` at a time, the last chunk as the engine's finished output."""
    deltas = []
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        deltas.append(state.process(ids[i:i + chunk], finished=last, finish_reason=finish_reason if last else None,
                                    drop_last_token=drop_last_token and last))
        if deltas[-1].finished:
            break
    return deltas


def test_eos_is_never_detokenized(tokenizer):
    ids = encode(tokenizer, "Hello 👍🏽 world") + [tokenizer.eos_token_id]
    for chunk in (1, 2, 3, len(ids)):
        state = RequestOutputState(tokenizer, [1], SamplingParams(skip_special_tokens=False))
        deltas = run(state, ids, chunk, finish_reason="stop", drop_last_token=True)
        assert "".join(d.text for d in deltas) == "Hello 👍🏽 world" == state.output_text
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert deltas[-1] == TextDelta(deltas[-1].text, True, "stop", None, abort_engine=False)
        assert state.num_output_tokens == len(ids)


def test_stop_token_id_is_dropped(tokenizer):
    ids = encode(tokenizer, "one. two")
    dot = encode(tokenizer, ".")[0]
    assert ids[1] == dot
    state = RequestOutputState(tokenizer, [1], SamplingParams(stop_token_ids=(dot,)))
    assert state.process(ids[:1]) == TextDelta("one", False, None, None, False)
    assert state.process(ids[1:2], finished=True, finish_reason="stop", stop_reason=dot,
                         drop_last_token=True) == TextDelta("", True, "stop", dot, False)


def test_stop_string_aborts_the_engine_request(tokenizer):
    text = "The answer is 42.\nUser: more text follows here"
    ids = encode(tokenizer, text)
    for include, expected in [(False, "The answer is 42."), (True, "The answer is 42.\nUser:")]:
        for chunk in (1, 3):
            params = SamplingParams(stop=("\nUser:", "Assistant:"), include_stop_str_in_output=include)
            state = RequestOutputState(tokenizer, [1], params)
            deltas = run(state, ids, chunk)
            assert "".join(d.text for d in deltas) == expected == state.output_text
            assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
            assert deltas[-1].stop_reason == "\nUser:"
            assert deltas[-1].abort_engine  # the engine was still generating
            assert not any(d.finished for d in deltas[:-1])
            assert state.finished


def test_stop_string_in_the_engines_last_output_needs_no_abort(tokenizer):
    ids = encode(tokenizer, "abc STOP def")
    state = RequestOutputState(tokenizer, [1], SamplingParams(stop=("STOP",)))
    delta = state.process(ids, finished=True, finish_reason="length")
    assert delta == TextDelta("abc ", True, "stop", "STOP", abort_engine=False)


def test_held_back_text_is_flushed_at_the_end(tokenizer):
    ids = encode(tokenizer, "tail text")
    state = RequestOutputState(tokenizer, [1], SamplingParams(stop=("a very long stop string",)))
    deltas = run(state, ids, 1, finish_reason="length")
    assert [d.text for d in deltas[:-1]] == [""] * (len(deltas) - 1)  # all within the holdback
    assert deltas[-1] == TextDelta("tail text", True, "length", None, False)


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = encode(tokenizer, "stop here, stop there")
    stop_ids = encode(tokenizer, "stop")
    assert ids[:len(stop_ids)] == stop_ids
    # The first "stop" ends within the first min_tokens outputs: not a stop; the second is.
    state = RequestOutputState(tokenizer, [1], SamplingParams(stop=("stop",), min_tokens=len(stop_ids)))
    deltas = run(state, ids, 2)
    assert "".join(d.text for d in deltas) == "stop here, "
    assert deltas[-1].stop_reason == "stop" and deltas[-1].abort_engine
    # min_tokens counted inside one multi-token output too.
    state = RequestOutputState(tokenizer, [1], SamplingParams(stop=("stop",), min_tokens=len(stop_ids)))
    assert state.process(ids).text == "stop here, "


def test_finished_state_takes_no_more_outputs(tokenizer):
    state = RequestOutputState(tokenizer, [1], SamplingParams(stop=("b",)))
    assert state.process(encode(tokenizer, "a b c")).finished
    with pytest.raises(AssertionError):
        state.process(encode(tokenizer, "d"))
