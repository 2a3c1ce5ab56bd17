"""The chat templates that go with the tool-call parsers (services/processor/chat_templates/, passed
with --chat-template), loaded as the processor loads them and rendered by transformers on SmolLM2's
tokenizer: each shows the model the tools, writes an assistant's earlier calls in the format its
parser reads back (the same calls), and shows the tools' results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.gateway.protocol import ChatMessage
from services.gateway.tool_parsers import TOOL_PARSERS
from services.processor.tokenizer import load_tokenizer

TEMPLATES = Path(__file__).resolve().parents[2] / "services" / "processor" / "chat_templates"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ARGUMENTS = {"city": "Paris", "days": [1, 2], "metric": True, "note": None, "nested": {"a": 1.5},
             "quote": "it's \"here\" } ] )", "accents": "Zürich"}
CALLS = [{"id": "call00001", "type": "function",
          "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)}},
         {"id": "call00002", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
RESULT = {"role": "tool", "tool_call_id": "call00001", "content": "Sunny, 24 C"}


@pytest.fixture(scope="module", params=["llama3_json", "mistral", "pythonic"])
def parser_and_tokenizer(request: pytest.FixtureRequest, model_path: Path):
    template = TEMPLATES / f"tool_chat_template_{request.param}.jinja"
    return request.param, load_tokenizer(model_path, str(template))


def render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    # As the gateway hands messages to the processor (arguments as objects), then the processor's call.
    conversation = [ChatMessage(**m).to_template() for m in messages]
    return tokenizer.apply_chat_template(conversation, tools=TOOLS, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def test_the_template_writes_calls_as_its_parser_reads_them(parser_and_tokenizer):
    parser, tokenizer = parser_and_tokenizer
    asked = render(tokenizer, USER, add_generation_prompt=True)
    assert json.dumps(TOOLS[0]["function"]["parameters"]) in asked and "Be brief." in asked
    answered = render(tokenizer, [*USER, {"role": "assistant", "content": None, "tool_calls": CALLS}],
                      add_generation_prompt=False)
    assert answered.startswith(asked), (asked, answered)  # the calls are what the model would have written
    written = answered[len(asked):].removesuffix(tokenizer.eos_token).removesuffix("<|eom_id|>")
    parsed = TOOL_PARSERS[parser]().parse(written)
    assert parsed.content is None, written
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", ARGUMENTS), ("get_time", {})]


def test_the_template_shows_the_tools_results_and_asks_for_the_next_answer(parser_and_tokenizer):
    parser, tokenizer = parser_and_tokenizer
    follow_up = {"role": "user", "content": "And tomorrow?"}
    text = render(tokenizer, [*USER, {"role": "assistant", "tool_calls": CALLS}, RESULT, follow_up],
                  add_generation_prompt=True)
    assert text.index("Weather in Paris?") < text.index("Sunny, 24 C") < text.index("And tomorrow?")
    ending = {"mistral": "And tomorrow?[/INST]"}.get(parser, "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert text.endswith(ending)
    plain = render(tokenizer, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert "get_weather" in plain  # tools without a system message still reach the model
