"""Tool-call readers: each parser (hermes, llama3_json, mistral, pythonic) on whole outputs and on
streams cut at every character, malformed calls left as content, and the forced (required / named)
reader's stream; a stream's pieces always add up to the whole."""

from __future__ import annotations

import json
import re
import time

import pytest

from services.gateway.protocol import ChatCompletionRequest, ChatMessage, DeltaToolCall, FunctionCall
from services.gateway.tool_calls import (ForcedToolCalls, ToolChoice, finish_reason_with_calls, tool_call_reader,
                                         with_parser_tokens)
from services.gateway.tool_parsers import TOOL_PARSERS, HermesToolParser

WEATHER = FunctionCall(name="get_weather", arguments='{"city": "Paris"}')
ROME = FunctionCall(name="get_weather", arguments='{"city": "Rome"}')
TIME = FunctionCall(name="get_time", arguments="{}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
MISTRAL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'

# (parser, output, content, calls): whole outputs, and malformed calls left as they were written.
SAMPLES = [
    ("hermes", "No call here.", "No call here.", []),
    ("hermes", CALL, None, [WEATHER]),
    ("hermes", "Let me check. " + CALL + CALL.replace("Paris", "Rome"), "Let me check.", [WEATHER, ROME]),
    ("hermes", "Checking. " + CALL + " Done.", "Checking.  Done.", [WEATHER]),  # text after a call too
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [WEATHER]),  # unclosed
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": ', '<tool_call>{"name": "get_weather", "arguments": ',
     []),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None,
     [FunctionCall(name="f", arguments='{"x": 1}')]),  # arguments already a string
    ("hermes", "<tool_call>" + "[" * 100_000 + "</tool_call>", "<tool_call>" + "[" * 100_000 + "</tool_call>", []),
    ("llama3_json", LLAMA, None, [WEATHER]),
    ("llama3_json", "<|python_tag|>" + LLAMA, None, [WEATHER]),
    ("llama3_json", LLAMA.replace("parameters", "arguments") + "; " + LLAMA.replace("Paris", "Rome") + ' ; '
     '{"name": "get_time", "parameters": {}}', None, [WEATHER, ROME, TIME]),
    ("llama3_json", "Here it is: <|python_tag|>" + LLAMA + " Anything else?", "Here it is:  Anything else?",
     [WEATHER]),
    ("llama3_json", '{"name": "f", "parameters": {"q": "a }\\" {"}}', None,
     [FunctionCall(name="f", arguments='{"q": "a }\\" {"}')]),  # braces and quotes inside a string
    ("llama3_json", 'A set {1, 2} and {"name": "Ann"} are no calls.', 'A set {1, 2} and {"name": "Ann"} are no calls.',
     []),
    ("llama3_json", '<|python_tag|>print("hi")', '<|python_tag|>print("hi")', []),
    ("llama3_json", LLAMA[:-10], LLAMA[:-10], []),  # cut short
    ("llama3_json", "; " + LLAMA + ";", ";", [WEATHER]),  # only a ";" after a call separates
    ("mistral", MISTRAL, None, [WEATHER, TIME]),
    ("mistral", "Sure. " + MISTRAL, "Sure.", [WEATHER, TIME]),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time{}', None, [WEATHER, TIME]),
    ("mistral", "[TOOL_CALLS] in words", "[TOOL_CALLS] in words", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather"}, "oops"]', '[TOOL_CALLS][{"name": "get_weather"}, "oops"]', []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par',
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par', []),
    ("pythonic", "[get_weather(city='Paris')]", None, [WEATHER]),
    ("pythonic", " [get_weather(city=\"Paris\"), get_time()]\n", None, [WEATHER, TIME]),
    ("pythonic", "[f(a=[1, -2.5, {'b': None}], c=True, d=(1, 2), e=')]\\'')] Done.", "Done.",
     [FunctionCall(name="f", arguments='{"a": [1, -2.5, {"b": null}], "c": true, "d": [1, 2], "e": ")]\'"}')]),
    ("pythonic", "Calling [get_weather(city='Paris')]", "Calling [get_weather(city='Paris')]", []),  # not first
    ("pythonic", "[get_weather('Paris')]", "[get_weather('Paris')]", []),  # positional
    ("pythonic", "[get_weather(city=paris)]", "[get_weather(city=paris)]", []),  # a name, not a literal
    ("pythonic", "[get_weather(city=__import__('os').getcwd())]", "[get_weather(city=__import__('os').getcwd())]",
     []),  # never run
    ("pythonic", "[f(a={1, 2}), g(b=1e999)]", "[f(a={1, 2}), g(b=1e999)]", []),  # no JSON for a set, infinity
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
    ("pythonic", "[get_weather(city='Par", "[get_weather(city='Par", []),  # cut short
]


def streamed(parser: str, pieces: list[str]) -> tuple[str, list[DeltaToolCall]]:
    reader, content, calls = TOOL_PARSERS[parser](), "", []
    for i, piece in enumerate(pieces):
        out = reader.feed(piece, i == len(pieces) - 1)
        content, calls = content + out.content, calls + out.calls
    return content, calls


@pytest.mark.parametrize("parser, text, content, calls", SAMPLES)
def test_parsers_read_whole_outputs_and_any_cut_of_their_stream(parser, text, content, calls):
    assert TOOL_PARSERS[parser]().parse(text) == (content, calls)
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] if len(text) < 1000 else [[text]]
    for pieces in [*cuts, list(text) if len(text) < 1000 else [text], [*list(text[:40]), text[40:], ""]]:
        streamed_content, streamed_calls = streamed(parser, pieces)
        assert [c.index for c in streamed_calls] == list(range(len(calls)))
        assert [FunctionCall(name=c.function.name, arguments=c.function.arguments) for c in streamed_calls] == calls
        assert all(c.type == "function" for c in streamed_calls)
        # Streamed content keeps the whitespace around the calls that the whole output's strips.
        assert streamed_content.strip() == (content or "").strip() and (calls or streamed_content == text)


@pytest.mark.parametrize("parser, tag", [("hermes", "<tool_call>"), ("llama3_json", "<|python_tag|>"),
                                         ("mistral", "[TOOL_CALLS]")])
def test_a_stream_holds_back_only_what_may_open_a_call(parser, tag):
    reader = TOOL_PARSERS[parser]()
    assert reader.feed("Sure " + tag[:4], finished=False).content == "Sure "
    assert reader.feed("x", finished=False).content == tag[:4] + "x"  # not the tag after all
    assert reader.feed(" " + tag[:-1], finished=True).content == " " + tag[:-1]  # the end: nothing is held back


def test_pythonic_streams_text_at_once_unless_it_opens_with_a_list():
    reader = TOOL_PARSERS["pythonic"]()
    assert reader.feed("  ", finished=False).content == ""  # the opening is not decided yet
    assert reader.feed("It is [sunny", finished=False).content == "  It is [sunny"
    opened = TOOL_PARSERS["pythonic"]()
    assert opened.feed("[get_weather(city=", finished=False) == ("", [])
    assert opened.feed("'Paris')]", finished=False).calls[0].function.name == "get_weather"  # as the list closes


def test_call_ids_are_the_parsers():
    assert re.fullmatch(r"[A-Za-z0-9]{9}", TOOL_PARSERS["mistral"].call_id())
    [call] = TOOL_PARSERS["mistral"]().feed(MISTRAL[:MISTRAL.index(", {")] + "]", True).calls
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
    for parser in ("hermes", "llama3_json", "pythonic"):
        assert TOOL_PARSERS[parser].call_id().startswith("chatcmpl-tool-")


def test_forced_named_call_streams_its_arguments():
    reader = ForcedToolCalls(ToolChoice("get_weather", {"type": "object"}))
    first, second, last = reader.feed('{"city":', False), reader.feed('"Paris"}', False), reader.feed("", True)
    assert (first.calls[0].id is not None, first.calls[0].function.name) == (True, "get_weather")
    assert second.calls[0].id is None and second.calls[0].function.name is None and not last.calls
    assert first.calls[0].function.arguments + second.calls[0].function.arguments == '{"city":"Paris"}'
    assert reader.parse('{"city":"Paris"}').calls == [FunctionCall(name="get_weather", arguments='{"city":"Paris"}')]
    assert reader.parse('{"city":"Pa').calls == []  # cut short: no call, the text stays content


def test_forced_required_calls_come_whole_at_the_end():
    reader = ForcedToolCalls(ToolChoice(None, {"type": "array"}))
    text = json.dumps([{"name": "get_weather", "parameters": {"city": "Paris"}}])
    assert reader.feed(text[:10], False).calls == []
    [call] = reader.feed(text[10:], True).calls
    assert (call.index, call.function.name, json.loads(call.function.arguments)) == (0, "get_weather",
                                                                                     {"city": "Paris"})
    cut = ForcedToolCalls(ToolChoice(None, {"type": "array"}))
    assert cut.feed('[{"name":', True) == ('[{"name":', [])


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], **fields)


def test_which_reader_and_finish_reason():
    assert tool_call_reader(chat(), "hermes") is None  # no tools
    assert tool_call_reader(chat(tools=TOOLS, tool_choice="none"), "hermes") is None
    assert tool_call_reader(chat(tools=TOOLS), None) is None  # auto without a parser (the gateway refuses it)
    assert isinstance(tool_call_reader(chat(tools=TOOLS), "hermes")(), HermesToolParser)
    assert isinstance(tool_call_reader(chat(tools=TOOLS, tool_choice="required"), None)(), ForcedToolCalls)
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert finish_reason_with_calls(chat(tools=TOOLS, tool_choice=named), "stop") == "stop"
    assert finish_reason_with_calls(chat(tools=TOOLS, tool_choice="required"), "stop") == "tool_calls"
    assert finish_reason_with_calls(chat(tools=TOOLS), "length") == "length"


def test_mistral_keeps_the_special_tokens_its_calls_are_marked_with():
    auto = chat(tools=TOOLS)
    assert with_parser_tokens(auto, "mistral").skip_special_tokens is False
    assert with_parser_tokens(auto, "hermes").skip_special_tokens is True
    assert with_parser_tokens(chat(tools=TOOLS, tool_choice="none"), "mistral").skip_special_tokens is True
    assert with_parser_tokens(chat(tools=TOOLS, tool_choice="required"), "mistral").skip_special_tokens is True
    assert with_parser_tokens(chat(), "mistral").skip_special_tokens is True


def test_the_template_reads_an_assistants_call_arguments_as_objects():
    # vLLM's rule: OpenAI sends arguments as JSON text, tool-use templates write them out themselves.
    call = {"id": "abcdefghi", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    message = ChatMessage(role="assistant", content=None, tool_calls=[call, {**call, "function": {"name": "get_time"}}])
    assert [c["function"]["arguments"] for c in message.to_template()["tool_calls"]] == [{"city": "Paris"}, {}]
    assert "tool_calls" not in ChatMessage(role="assistant", content="Hi", tool_calls=[]).to_template()
    bad = ChatMessage(role="assistant", tool_calls=[{**call, "function": {"name": "f", "arguments": "{city"}}])
    with pytest.raises(ValueError, match="arguments are not JSON"):
        bad.to_template()


@pytest.mark.parametrize("parser", ["llama3_json", "mistral", "pythonic"])
def test_an_unclosed_bracket_costs_a_stream_linear_time(parser):
    # A bracket that never closes holds the rest of the answer: each delta resumes the scan where
    # the last one stopped, never from the bracket again (from there: minutes, not a fraction of a second).
    text = {"llama3_json": "{", "mistral": "[TOOL_CALLS][", "pythonic": "["}[parser] + '"a" (b) [c] ' * 10_000
    reader = TOOL_PARSERS[parser]()
    start = time.perf_counter()
    content = "".join(reader.feed(text[i:i + 4], False).content for i in range(0, len(text), 4))
    assert content == "" and reader.feed("", True).content == text
    assert time.perf_counter() - start < 10
