"""Structured outputs and tool calling through the whole split, with the official `openai`
client against the session's shared `kvmesh serve` (tests/conftest.py): every output of a
JSON schema parses and validates, regex and choice outputs match, forced tool calls parse and their
arguments validate, streamed pieces reassemble into the non-streamed answer, and bad constraints
are 400s naming their field."""

from __future__ import annotations

import json
import re
import uuid

import jsonschema
import openai
import pytest

from loadtests.json_schemas import JSON_SCHEMAS
from tests.services.test_openai_api import client, http, model  # noqa: F401 (the same fixtures)
from tests.unit.test_metrics import samples
from tests.services.test_metrics_serve import fetch, total

MAX_TOKENS = 80  # enough for every schema of loadtests/json_schemas.py on this model (the longest ~45)
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS}
SAMPLED = {"temperature": 1.0, "seed": 7, "max_tokens": MAX_TOKENS}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def ask(name: str) -> list[dict]:
    # Short (the shared stack's context is 256 tokens): the constraint, not the prompt, shapes the JSON.
    return [{"role": "user", "content": f"Give an example of a {name.replace('_', ' ')} as JSON."}]


def response_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def streamed_text(stream) -> tuple[str, str | None]:
    text, finish_reason = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish_reason = choice.finish_reason or finish_reason
    return text, finish_reason


@pytest.mark.parametrize("name, schema", JSON_SCHEMAS, ids=[name for name, _ in JSON_SCHEMAS])
def test_json_schema_outputs_validate_greedy_and_sampled_streamed_or_not(client, model, name, schema):
    for sampling in (GREEDY, SAMPLED):
        answer = client.chat.completions.create(model=model, messages=ask(name),
                                                response_format=response_format(name, schema), **sampling)
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)
        # Streamed: the same tokens (greedy, or the same seed), so the same text.
        stream = client.chat.completions.create(model=model, messages=ask(name), stream=True,
                                                response_format=response_format(name, schema), **sampling)
        assert streamed_text(stream) == (choice.message.content, "stop")


def test_json_object_and_vllm_fields_constrain_completions_too(client, model):
    answer = client.chat.completions.create(model=model, messages=ask("object"),
                                            response_format={"type": "json_object"}, **GREEDY)
    assert isinstance(json.loads(answer.choices[0].message.content), dict)
    schema = dict(JSON_SCHEMAS)["two_fields"]
    for extra in ({"structured_outputs": {"json": schema}}, {"guided_json": json.dumps(schema)}):
        text = client.completions.create(model=model, prompt="A person as JSON:", extra_body=extra, **GREEDY)
        jsonschema.validate(json.loads(text.choices[0].text), schema)


@pytest.mark.parametrize("extra", [{"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,4}"}},
                                   {"guided_regex": "[0-9]{3}-[a-z]{2,4}"}])
def test_regex_outputs_match(client, model, extra):
    for sampling in (GREEDY, SAMPLED):
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "A code?"}],
                                                extra_body=extra, **sampling)
        assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", answer.choices[0].message.content), answer


def test_choice_outputs_are_one_of_the_choices(client, model):
    choices = ["yes", "no", "maybe not"]
    messages = [{"role": "user", "content": "Is the sky green?"}]
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        for sampling in (GREEDY, SAMPLED):
            answer = client.chat.completions.create(model=model, messages=messages, extra_body=extra, n=2, **sampling)
            assert all(c.message.content in choices for c in answer.choices), answer


def test_grammar_outputs_are_in_the_grammar(client, model):
    lark = 'start: "(" num "+" num ")"\nnum: /[1-9][0-9]?/'
    gbnf = 'root ::= "(" num "+" num ")"\nnum ::= [1-9] [0-9]?'
    for extra in ({"structured_outputs": {"grammar": lark}}, {"guided_grammar": gbnf}):
        answer = client.completions.create(model=model, prompt="A sum:", extra_body=extra, **GREEDY)
        assert re.fullmatch(r"\([1-9][0-9]?\+[1-9][0-9]?\)", answer.choices[0].text), answer


@pytest.mark.parametrize("field, body", [
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                   "schema": {"type": "nope"}}}}),
    ("structured_outputs", {"structured_outputs": {"regex": "[0-9"}}),
    ("structured_outputs", {"structured_outputs": {"regex": "a", "choice": ["b"]}}),
    ("guided_json", {"guided_json": "{not json"}),
    ("guided_grammar", {"guided_grammar": "root ::= undefined_rule"}),
    ("guided_choice", {"guided_choice": []}),
    ("guided_regex", {"structured_outputs": {"regex": "a"}, "guided_regex": "b"}),  # two constraints
    ("tool_choice", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
])
def test_bad_constraints_are_400s_naming_their_field(client, model, field, body):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], extra_body=body,
                                       **GREEDY)
    assert e.value.body["param"] == field, e.value.body


def test_named_tool_choice_calls_that_function(client, model):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=named, **GREEDY)
    choice = answer.choices[0]
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["get_weather"])
    assert choice.finish_reason == "stop"  # vLLM's (and OpenAI's) for a named function
    stream = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=named,
                                            stream=True, **GREEDY)
    assert reassembled(stream) == ([("get_weather", call.function.arguments)], "stop")


def test_required_tool_choice_makes_valid_calls(client, model):
    messages = [{"role": "user", "content": "What time is it in London, and the weather there?"}]
    for sampling in (GREEDY, SAMPLED):
        answer = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                                **sampling)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
        stream = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                                stream=True, **sampling)
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert reassembled(stream) == (calls, "tool_calls")
    one = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, **GREEDY)
    assert len(one.choices[0].message.tool_calls) == 1


def test_open_tool_parameters_still_give_calls_that_end(client, model):
    # vLLM's test tool: no additionalProperties, so by JSON schema's letter the object is open. It is
    # compiled closed (xgrammar's strict mode, vLLM's default): the call ends, with no other key.
    parameters = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"]}
    tools = [{"type": "function", "function": {"name": "get_current_weather", "parameters": parameters}}]
    messages = [{"role": "user", "content": "What is the weather in Dallas, Texas, in fahrenheit?"}]
    named = {"type": "function", "function": {"name": "get_current_weather"}}
    for tool_choice, finish_reason in (("required", "tool_calls"), (named, "stop")):
        answer = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice=tool_choice,
                                                **GREEDY)
        choice = answer.choices[0]
        assert choice.finish_reason == finish_reason and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            assert set(json.loads(call.function.arguments)) == {"city", "unit"}, call.function.arguments


def reassembled(stream) -> tuple[list[tuple[str, str]], str | None]:
    """OpenAI's rule: deltas of one index add up; the first carries its id, type and name."""
    calls: dict[int, list[str]] = {}
    finish_reason = None
    for chunk in stream:
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
            for delta in choice.delta.tool_calls or ():
                if delta.index not in calls:
                    assert delta.id and delta.type == "function" and delta.function.name, delta
                    calls[delta.index] = [delta.function.name, ""]
                calls[delta.index][1] += delta.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)], finish_reason


def test_a_grammar_compiles_once_and_is_counted(client, model, serve):
    url = serve.services["engine"]["metrics"]
    # A schema no other test sends (its title), so the first request compiles it and the second hits.
    schema = {"title": f"counted-{uuid.uuid4().hex}", "type": "object", "properties": {"n": {"enum": [1, 2]}},
              "required": ["n"], "additionalProperties": False}
    before = samples(fetch(url))
    for _ in range(2):
        answer = client.chat.completions.create(model=model, messages=ask("number"),
                                                response_format=response_format("n", schema), **GREEDY)
        jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
    after = samples(fetch(url))
    increase = {name: total(after, name) - total(before, name) for name in (
        "kvmesh_engine_grammar_cache_misses_total", "kvmesh_engine_grammar_cache_hits_total",
        "kvmesh_engine_grammar_compile_seconds_count")}
    assert increase == {"kvmesh_engine_grammar_cache_misses_total": 1, "kvmesh_engine_grammar_cache_hits_total": 1,
                        "kvmesh_engine_grammar_compile_seconds_count": 1}


def test_batched_chat_makes_each_conversations_calls(http, model):
    conversations = [[{"role": "user", "content": f"The weather in {city}?"}] for city in ("Paris", "Oslo")]
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = http.post("/v1/chat/completions/batch", json={"model": model, "messages": conversations,
                                                             "tools": TOOLS, "tool_choice": named, **GREEDY})
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS["get_weather"])
