"""tool_choice "auto" through `kvmesh serve` with the official `openai` client, for each
--tool-call-parser (llama3_json, mistral, pythonic): a gateway of its own per parser in
front of the session's shared processor (procs.gateway_over). SmolLM2 writes none of these formats
of its own accord, so a regex (structured_outputs, which vLLM also takes beside tools) makes the real
model write the parser's format; the gateway's parser reads the calls back out of the real output,
whole and streamed. A malformed call stays content."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from tests.services.procs import Serve, client_for, gateway_over
from tests.services.test_structured_outputs import TOOLS

CITY = r'"(Paris|Rome)"'
# parser -> (a regex of two calls in its format, the content around them, a regex of a malformed call).
# hermes has its own test through the gateway in-process (tests/unit/test_gateway_stack.py).
FORMATS = {
    "llama3_json": (r'OK\. <\|python_tag\|>\{"name": "get_weather", "parameters": \{"city": ' + CITY + r'\}\}; '
                    r'\{"name": "get_time", "parameters": \{\}\}', "OK.",
                    r'<\|python_tag\|>\{"name": "get_weather", "parameters": \{city\}\}'),
    "mistral": (r'OK\. \[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": \{"city": ' + CITY + r'\}\}, '
                r'\{"name": "get_time", "arguments": \{\}\}\]', "OK.", r'\[TOOL_CALLS\]\[\{"name": get_weather\}\]'),
    "pythonic": (r"\[get_weather\(city='(Paris|Rome)'\), get_time\(\)\]", None, r"\[get_weather\(city=Paris\)\]"),
}
IDS = {"mistral": re.compile(r"[A-Za-z0-9]{9}")}  # Mistral's; the others vLLM's chatcmpl-tool-<hex>
DEFAULT_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
GREEDY = {"temperature": 0, "max_tokens": 48}


@pytest.fixture(scope="module", params=list(FORMATS))
def parser_gateway(request: pytest.FixtureRequest, serve: Serve) -> Iterator[tuple[str, Serve]]:
    with gateway_over(serve, ["--enable-auto-tool-choice", "--tool-call-parser", request.param]) as gateway:
        yield request.param, gateway


def ask(gateway: Serve, regex: str, stream: bool):
    client, model = client_for(gateway)
    return client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, stream=stream,
                                          extra_body={"structured_outputs": {"regex": regex}}, **GREEDY)


def read_stream(stream) -> tuple[str, list, str | None]:
    """A streamed choice's content, tool-call deltas and finish_reason."""
    content, deltas, finish_reason = "", [], None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            deltas += choice.delta.tool_calls or []
            finish_reason = choice.finish_reason or finish_reason
    return content, deltas, finish_reason


def test_the_parser_reads_the_models_calls_whole_and_streamed(parser_gateway):
    parser, gateway = parser_gateway
    regex, content, _ = FORMATS[parser]
    choice = ask(gateway, regex, stream=False).choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or ()]
    assert calls in ([("get_weather", {"city": city}), ("get_time", {})] for city in ("Paris", "Rome")), choice
    assert choice.finish_reason == "tool_calls" and choice.message.content == content, choice
    assert all((IDS.get(parser) or DEFAULT_ID).fullmatch(c.id) for c in choice.message.tool_calls), choice
    # The same (greedy) output streamed: each call whole in one delta, the text around them as content.
    streamed_content, deltas, finish_reason = read_stream(ask(gateway, regex, stream=True))
    assert [(d.index, d.type, d.function.name, d.function.arguments) for d in deltas] == [
        (i, "function", c.function.name, c.function.arguments) for i, c in enumerate(choice.message.tool_calls)]
    assert all((IDS.get(parser) or DEFAULT_ID).fullmatch(d.id) for d in deltas), deltas
    assert (streamed_content.strip(), finish_reason) == (content or "", "tool_calls")


def test_a_malformed_call_stays_content(parser_gateway):
    parser, gateway = parser_gateway
    malformed = FORMATS[parser][2]
    choice = ask(gateway, malformed, stream=False).choices[0]
    assert re.fullmatch(malformed, choice.message.content) and not choice.message.tool_calls, choice
    assert choice.finish_reason == "stop"
