"""The gateway's reading of a request's constraint: every field that can ask for one, the same
constraint whichever field (and spelling) asked, the required / named tools' schemas, and a 400
naming the field for everything else."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.common.config import GrammarLimits
from services.common.structured_outputs import StructuredOutputs
from services.gateway.errors import APIError
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.structured import structured_outputs_of, validate_structured_outputs

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["b"]}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "g"}}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "x", **fields})


def read_and_validate(body: ChatCompletionRequest, limits: GrammarLimits = GrammarLimits()) -> StructuredOutputs | None:
    """The gateway's two steps: the constraint read and bounded, then compiled (off the loop)."""
    constraint = structured_outputs_of(body, limits)
    asyncio.run(validate_structured_outputs(body, constraint, limits))
    return constraint


def test_every_spelling_of_a_schema_is_one_constraint():
    # Compact, in the sender's key order (the output's order): one grammar-cache entry for all of them.
    expected = StructuredOutputs("json", json.dumps(SCHEMA, separators=(",", ":")))
    for body in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
                 {"structured_outputs": {"json": SCHEMA}}, {"structured_outputs": {"json": json.dumps(SCHEMA)}},
                 {"guided_json": SCHEMA}, {"guided_json": json.dumps(SCHEMA, indent=2)}):
        assert structured_outputs_of(chat(**body)) == expected, body
        assert structured_outputs_of(completion(**body)) == expected, body


def test_the_other_kinds():
    assert structured_outputs_of(chat()) is None
    assert structured_outputs_of(chat(response_format={"type": "text"})) is None
    assert structured_outputs_of(chat(response_format={"type": "json_object"})) == StructuredOutputs("json_object")
    assert structured_outputs_of(chat(structured_outputs={"json_object": True})) == StructuredOutputs("json_object")
    assert structured_outputs_of(chat(guided_regex="[0-9]+")) == StructuredOutputs("regex", "[0-9]+")
    assert structured_outputs_of(chat(guided_choice=["a b", 'c"d'])) == StructuredOutputs("choice", '["a b", "c\\"d"]')
    assert structured_outputs_of(chat(structured_outputs={"grammar": 'root ::= "x"'})).kind == "grammar"
    # A schema-less json_schema format is any JSON value, as is the schema `true`.
    assert structured_outputs_of(chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}})) == \
        StructuredOutputs("json", "{}") == structured_outputs_of(chat(guided_json="true"))


def test_forced_tool_choices_constrain_to_the_calls_json():
    named = structured_outputs_of(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}}))
    assert json.loads(named.spec) == SCHEMA
    required = json.loads(structured_outputs_of(chat(tools=TOOLS, tool_choice="required")).spec)
    assert required["type"] == "array" and required["minItems"] == 1 and "maxItems" not in required
    assert [c["properties"]["name"] for c in required["items"]["anyOf"]] == [{"const": "f"}, {"const": "g"}]
    assert required["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}  # no parameters: any
    one = json.loads(structured_outputs_of(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)).spec)
    assert one["maxItems"] == 1
    assert structured_outputs_of(chat(tools=TOOLS, tool_choice="none")) is None
    assert structured_outputs_of(chat(tools=TOOLS, tool_choice="auto")) is None  # the model decides


@pytest.mark.parametrize("fields, param, message", [
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs", "structured_outputs.regex: invalid regex"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one of json, regex, choice, grammar, json_object"),
    ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs", "got json, regex"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs", "whitespace_pattern"),
    ({"guided_json": "{nope"}, "guided_json", "the schema is not JSON"),
    ({"guided_json": {"type": "nope"}}, "guided_json", "Invalid type"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty strings"),
    ({"guided_grammar": ""}, "guided_grammar", "must not be empty"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs its json_schema"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "guided_regex, guided_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "h"}}}, "tool_choice",
     "not among the tools ('f', 'g')"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools", "tools[0] must be"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "guided_regex, tool_choice"),
])
def test_bad_constraints_are_400s_naming_the_field(fields, param, message):
    with pytest.raises(APIError) as e:
        read_and_validate(chat(**fields))
    assert e.value.status == 400 and e.value.info.param == param and message in e.value.info.message, e.value.info
