"""Tool-call parsers for tool_choice "auto" (vLLM's --tool-call-parser): the model's own way of
writing calls, read out of its text. The chat template shows it the tools; nothing constrains it.

    hermes   <tool_call>{"name": "f", "arguments": {...}}</tool_call>, any number, after optional
             text (Hermes 2 Pro, Qwen 2.5 and 3, and every model trained on their format)

A parser reads a whole output (`parse`) or a stream of text deltas (`feed`): text outside the tags
is content, streamed as it comes (less any tail that may open a tag); each call is streamed whole
once its closing tag (or the end of the output) arrives.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import NamedTuple

from services.common.config import TOOL_CALL_PARSERS
from services.gateway.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall


class ParsedOutput(NamedTuple):
    content: str | None  # the text outside the calls; None when there is none
    calls: list[FunctionCall]


class StreamedPiece(NamedTuple):
    content: str  # "" when none
    calls: list[DeltaToolCall]


class HermesToolParser:
    START, END = "<tool_call>", "</tool_call>"
    CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def __init__(self) -> None:
        self._buffer = ""  # text not yet streamed: a call being written, or what may open one
        self._num_calls = 0

    @classmethod
    def parse(cls, text: str) -> ParsedOutput:
        """A whole output. A call whose JSON does not parse (or lacks a name) is left in the content."""
        calls = [call for call in map(_call_of, cls.CALL.findall(text)) if call is not None]
        if not calls:
            return ParsedOutput(text, [])
        content = text[:text.index(cls.START)].strip()
        return ParsedOutput(content or None, calls)

    def feed(self, text: str, finished: bool) -> StreamedPiece:
        """The next text delta of a streamed output; `finished`: it is the last."""
        self._buffer += text
        content, calls = "", []
        while self._buffer:
            start = self._buffer.find(self.START)
            if start < 0:
                # Hold back a tail that may be the start of "<tool_call>" unless the output ended.
                keep = 0 if finished else _partial_prefix(self._buffer, self.START)
                content += self._buffer[:len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            content += self._buffer[:start]
            end = self._buffer.find(self.END, start)
            if end < 0 and not finished:
                self._buffer = self._buffer[start:]
                break
            body = self._buffer[start + len(self.START):] if end < 0 else self._buffer[start + len(self.START):end]
            self._buffer = "" if end < 0 else self._buffer[end + len(self.END):]
            call = _call_of(body)
            if call is None:  # not a call after all: as content, as parse() leaves it
                content += self.START + body + ("" if end < 0 else self.END)
                continue
            calls.append(DeltaToolCall(index=self._num_calls, id=tool_call_id(), type="function",
                                       function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
            self._num_calls += 1
        return StreamedPiece(content, calls)


def _call_of(body: str) -> FunctionCall | None:
    try:
        call = json.loads(body)
        name, arguments = call["name"], call.get("arguments", call.get("parameters", {}))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    if not isinstance(name, str) or not name:
        return None
    return FunctionCall(name=name, arguments=arguments if isinstance(arguments, str)
                        else json.dumps(arguments, ensure_ascii=False))


def _partial_prefix(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


TOOL_PARSERS: dict[str, type[HermesToolParser]] = {"hermes": HermesToolParser}
assert set(TOOL_PARSERS) == set(TOOL_CALL_PARSERS), "--tool-call-parser's choices are this registry's names"
