"""Tool-call readers: the hermes parser on whole outputs and on streams cut at every character, and
the forced (required / named) reader's stream; a stream's pieces always add up to the whole."""

from __future__ import annotations

import json

import pytest

from services.gateway.protocol import ChatCompletionRequest, FunctionCall
from services.gateway.tool_calls import ForcedToolCalls, ToolChoice, finish_reason_with_calls, tool_call_reader
from services.gateway.tool_parsers import HermesToolParser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = FunctionCall(name="get_weather", arguments='{"city": "Paris"}')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("text, content, calls", [
    ("No call here.", "No call here.", []),
    (CALL, None, [WEATHER]),
    ("Let me check. " + CALL + CALL.replace("Paris", "Rome"), "Let me check.",
     [WEATHER, FunctionCall(name="get_weather", arguments='{"city": "Rome"}')]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [WEATHER]),  # unclosed at the end
    ('<tool_call>{"name": "get_weather", "arguments": ', '<tool_call>{"name": "get_weather", "arguments": ', []),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None,
     [FunctionCall(name="f", arguments='{"x": 1}')]),  # arguments already a string
])
def test_hermes_parses_whole_outputs_and_any_cut_of_their_stream(text, content, calls):
    assert HermesToolParser.parse(text) == (content, calls)
    for step in (1, 3, 7, len(text)):
        parser = HermesToolParser()
        streamed_content, streamed_calls = "", []
        pieces = [text[i:i + step] for i in range(0, len(text), step)]
        for i, piece in enumerate(pieces):
            out = parser.feed(piece, i == len(pieces) - 1)
            streamed_content += out.content
            streamed_calls += out.calls
        assert [c.index for c in streamed_calls] == list(range(len(calls)))
        assert [FunctionCall(name=c.function.name, arguments=c.function.arguments) for c in streamed_calls] == calls
        assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in streamed_calls)
        # Streamed content keeps the whitespace around the calls that the whole output's strips.
        assert streamed_content.strip() == (content or "").strip()


def test_hermes_holds_back_only_what_may_open_a_tag():
    parser = HermesToolParser()
    assert parser.feed("Sure <tool", finished=False).content == "Sure "
    assert parser.feed("box>", finished=False).content == "<toolbox>"
    assert parser.feed(" <", finished=True).content == " <"  # the end: nothing is held back


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
