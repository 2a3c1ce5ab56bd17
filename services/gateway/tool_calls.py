"""Tool calls: forced through the grammar (vLLM's rules for tool_choice "required" and a named function): the
output is constrained to the calls' JSON, which any model can then only produce, and turned into
OpenAI's `tool_calls`.

    tool_choice {"type": "function", "function": {"name": F}}   output: F's arguments, an object valid
                                                                 against F's parameters; finish_reason stop
    tool_choice "required"                                       output: [{"name": ..., "parameters": {...}}, ...]
                                                                 (one or more; one with parallel_tool_calls
                                                                 false); finish_reason tool_calls

Streamed, a named call's arguments go out as they come (its first delta carries id, type and
name); the calls of "required" go out whole once the output is complete (its JSON is only a list
of calls once it closes).

With tool_choice "auto" the server's tool-call parser (services/gateway/tool_parsers.py) reads the
calls out of whatever the model wrote; `tool_call_reader` gives a request's reader either way.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from services.gateway.errors import bad_request
from services.gateway.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from services.gateway.tool_parsers import TOOL_PARSERS, ParsedOutput, StreamedPiece, tool_call_id

ANY_OBJECT: dict[str, Any] = {"type": "object"}  # a function without parameters takes any object


class ToolChoice(NamedTuple):
    name: str | None  # the named function; None: "required"
    schema: dict[str, Any]  # what the output must be


def tool_choice_of(body: ChatCompletionRequest) -> ToolChoice | None:
    """The call the request forces (tool_choice "required" or named), None for "none" and "auto".
    APIError 400 for a named function that is not among the tools, or tools that are not functions."""
    choice = body.tool_choice
    if not body.tools or choice in (None, "none", "auto"):
        return None
    functions = {}
    for i, tool in enumerate(body.tools):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict) or not function.get("name"):
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                              f"'parameters': ...}}}}", "tools")
        functions[function["name"]] = function.get("parameters") or ANY_OBJECT
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, parameters in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolChoice(None, schema)
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if choice.get("type", "function") != "function" or not name:
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if name not in functions:
        raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools "
                          f"({', '.join(map(repr, functions))})", "tool_choice")
    return ToolChoice(name, functions[name])


class ForcedToolCalls:
    """A tool-call reader (the parsers' interface) for a forced call: the whole output is the calls' JSON."""

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self.text = ""
        self.started = False  # a named call's first delta (id, type, name) is out

    call_id = staticmethod(tool_call_id)

    def parse(self, text: str) -> ParsedOutput:
        """A whole output; no calls (the text as content) when it is not the calls' JSON (cut short)."""
        calls = self._calls(text)
        return ParsedOutput(text, []) if calls is None else ParsedOutput("", calls)

    def _calls(self, text: str) -> list[FunctionCall] | None:
        if self.choice.name is not None:
            return [FunctionCall(name=self.choice.name, arguments=text)] if _is_json(text) else None
        try:
            return [FunctionCall(name=c["name"], arguments=json.dumps(c["parameters"], ensure_ascii=False))
                    for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            return None

    def feed(self, text: str, finished: bool) -> StreamedPiece:
        """A named call's arguments stream as they come; "required"'s calls go out whole at the end."""
        self.text += text
        if self.choice.name is not None:
            if not text and self.started:
                return StreamedPiece("", [])
            first, self.started = not self.started, True
            return StreamedPiece("", [DeltaToolCall(
                index=0, id=tool_call_id() if first else None, type="function" if first else None,
                function=DeltaFunctionCall(name=self.choice.name if first else None, arguments=text))])
        if not finished:
            return StreamedPiece("", [])
        calls = self._calls(self.text)
        if calls is None:
            return StreamedPiece(self.text, [])  # cut short: no calls, the text as it is
        return StreamedPiece("", [DeltaToolCall(index=i, id=tool_call_id(), type="function",
                                                function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                                  for i, c in enumerate(calls)])


class ToolCallReader(Protocol):
    def parse(self, text: str) -> ParsedOutput: ...
    def feed(self, text: str, finished: bool) -> StreamedPiece: ...
    def call_id(self) -> str: ...


def tool_call_reader(body: ChatCompletionRequest, parser: str | None) -> Callable[[], ToolCallReader] | None:
    """What reads a choice's calls out of its text (a new reader per choice), None when the request
    calls no tools: its forced call's, or with tool_choice "auto" the server's --tool-call-parser."""
    choice = tool_choice_of(body)
    if choice is not None:
        return lambda: ForcedToolCalls(choice)
    if body.tools and body.tool_choice in (None, "auto") and parser is not None:
        return TOOL_PARSERS[parser]
    return None


def with_parser_tokens(body: ChatCompletionRequest, parser: str | None) -> ChatCompletionRequest:
    """The request as its parser reads it: with special tokens kept in the text when the parser's
    markers are special tokens (Mistral's [TOOL_CALLS]), which detokenizing would otherwise drop."""
    if parser is None or not TOOL_PARSERS[parser].KEEPS_SPECIAL_TOKENS or not body.skip_special_tokens:
        return body
    if tool_call_reader(body, parser) is not TOOL_PARSERS[parser]:  # no tools, or a forced call
        return body
    return body.model_copy(update={"skip_special_tokens": False})


def finish_reason_with_calls(body: ChatCompletionRequest, finish_reason: str | None) -> str | None:
    """vLLM's: a choice that made calls finishes with tool_calls, but for a named function (stop)."""
    if finish_reason == "stop" and not isinstance(body.tool_choice, dict):
        return "tool_calls"
    return finish_reason


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def tool_call_messages(calls: list[FunctionCall], call_id: Callable[[], str]) -> list[ToolCall]:
    return [ToolCall(id=call_id(), function=call) for call in calls]
