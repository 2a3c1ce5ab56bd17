"""Tool calls through the grammar (vLLM's rules for tool_choice "required" and a named function): the
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
"""

from __future__ import annotations

import json
import uuid
from typing import Any, NamedTuple

from services.gateway.errors import bad_request
from services.gateway.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)

ANY_OBJECT: dict[str, Any] = {"type": "object"}  # a function without parameters takes any object


class ToolChoice(NamedTuple):
    name: str | None  # the named function; None: "required"
    schema: dict[str, Any] | None  # what the output must be


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


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


def tool_calls_of(choice: ToolChoice, text: str) -> list[FunctionCall] | None:
    """The calls a complete output makes; None when it is not the calls' JSON (cut short by max_tokens)."""
    if choice.name is not None:
        return [FunctionCall(name=choice.name, arguments=text)] if _is_json(text) else None
    try:
        calls = json.loads(text)
        return [FunctionCall(name=c["name"], arguments=json.dumps(c["parameters"], ensure_ascii=False))
                for c in calls]
    except (ValueError, TypeError, KeyError):
        return None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class ToolCallStream:
    """One choice's streamed tool calls: OpenAI's deltas of the output's text as it comes."""

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self.text = ""
        self.started = False  # a named call's first delta (id, type, name) is out

    def deltas(self, text: str, finished: bool) -> list[DeltaToolCall]:
        """The deltas for `text` (what the output grew by); `finished`: the output is complete."""
        self.text += text
        if self.choice.name is not None:
            if not text and self.started:
                return []
            first = not self.started
            self.started = True
            return [DeltaToolCall(index=0, id=tool_call_id() if first else None, type="function" if first else None,
                                  function=DeltaFunctionCall(name=self.choice.name if first else None,
                                                             arguments=text))]
        if not finished:
            return []
        return [DeltaToolCall(index=i, id=tool_call_id(), type="function",
                              function=DeltaFunctionCall(name=call.name, arguments=call.arguments))
                for i, call in enumerate(tool_calls_of(self.choice, self.text) or ())]


def tool_call_messages(calls: list[FunctionCall]) -> list[ToolCall]:
    return [ToolCall(id=tool_call_id(), function=call) for call in calls]
