"""Tool-call parsers for tool_choice "auto" (vLLM's --tool-call-parser): the model's own way of
writing calls, read out of its text. The chat template shows it the tools; nothing constrains it.

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call>, any number, anywhere
                 (Hermes 2 Pro, Qwen 2.5 and 3, and every model trained on their format)
    llama3_json  {"name": "f", "parameters": {...}} ("arguments" too), anywhere, optionally after
                 <|python_tag|>, several separated by ";" (Llama 3.1, 3.2 and 4 JSON calls)
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...] (Mistral 7B v0.3 and on), or
                 [TOOL_CALLS]f{...} (tokenizers v11 and on); call ids of 9 letters and digits
    pythonic     [f(a=1, b='x'), g()] opening the answer: a Python list of calls whose arguments
                 are literals, read with `ast`, never run (Llama 3.2 and 4 pythonic, ToolACE)

A parser reads a whole output (`parse`) or a stream of text deltas (`feed`) with the same scanner,
so both read the same calls: the text outside them is content, streamed as it comes, less a tail
that may still open a call; each call is streamed whole once it closes (or the output ends). What
looks like a call but does not parse as one stays in the content, as it was written.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
from typing import Any, NamedTuple

from services.common.config import TOOL_CALL_PARSERS
from services.gateway.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall


class ParsedOutput(NamedTuple):
    content: str | None  # the text outside the calls; None when there is none
    calls: list[FunctionCall]


class StreamedPiece(NamedTuple):
    content: str  # "" when none
    calls: list[DeltaToolCall]


class Scanned(NamedTuple):
    pieces: list[str | FunctionCall]  # content and calls, in the order written
    consumed: int  # how much of the text they cover; the rest is undecided until more comes


class ToolParser:
    """A format's scanner read whole or as a stream. `_scan` takes the text not yet decided and
    whether the output has ended, and returns what that text decides: a prefix of the text, so that
    any cut of a stream reads as the whole output does. The formats whose calls follow a marker
    share its loop: `_opening` finds where the next call may start, `_calls_at` reads it."""

    TAG = ""  # what opens a call: a stream holds back a tail that may be its start
    QUOTES = '"'  # what delimits strings inside a call (JSON's)
    # Whether the format's markers are special tokens that detokenizing would drop (vLLM's
    # adjust_request for the same parser): requests read by it keep special tokens in their text.
    KEEPS_SPECIAL_TOKENS = False

    def __init__(self) -> None:
        self._buffer = ""  # text not yet decided: a call being written, or what may open one
        self._num_calls = 0
        self._brackets = BracketScan(self.QUOTES)

    def parse(self, text: str) -> ParsedOutput:
        """A whole output (read by a fresh parser, whatever this one has been fed)."""
        pieces = type(self)()._read(text, finished=True)
        calls = [p for p in pieces if isinstance(p, FunctionCall)]
        if not calls:
            return ParsedOutput(text, [])
        content = "".join(p for p in pieces if isinstance(p, str)).strip()
        return ParsedOutput(content or None, calls)

    def feed(self, text: str, finished: bool) -> StreamedPiece:
        """The next text delta of a streamed output; `finished`: it is the last."""
        content, calls = "", []
        for piece in self._read(text, finished):
            if isinstance(piece, str):
                content += piece
                continue
            calls.append(DeltaToolCall(index=self._num_calls, id=self.call_id(), type="function",
                                       function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments)))
            self._num_calls += 1
        return StreamedPiece(content, calls)

    @staticmethod
    def call_id() -> str:
        return tool_call_id()

    def _read(self, text: str, finished: bool) -> list[str | FunctionCall]:
        self._buffer += text
        pieces, consumed = self._scan(self._buffer, finished)
        assert consumed == len(self._buffer) or not finished, "the end of the output decides all of it"
        if consumed:
            self._buffer = self._buffer[consumed:]
            self._brackets.reset()
        return pieces

    def _scan(self, text: str, finished: bool) -> Scanned:
        pieces: list[str | FunctionCall] = []
        pos = 0
        while True:
            skipped = self._skip(text, pos, finished)
            if skipped is None:
                return Scanned(pieces, pos)
            start = self._opening(text, skipped)
            if start < 0:  # no call: content, less a tail that may open one unless the output ended
                stop = len(text) - (0 if finished else _partial_prefix(text[skipped:], self.TAG))
                pieces.append(text[skipped:stop])
                return Scanned(pieces, stop)
            pieces.append(text[skipped:start])
            read = self._calls_at(text, start, finished)
            if read is None:
                return Scanned(pieces, start)
            end, calls = read
            pieces += [text[start:end]] if calls is None else calls  # not calls: as written
            pos = end

    def _skip(self, text: str, pos: int, finished: bool) -> int | None:
        """Where the text from `pos` goes on after what is neither content nor a call; None: undecided."""
        return pos

    def _opening(self, text: str, pos: int) -> int:
        """Where the next call may start from `pos`, -1 when none can."""
        return text.find(self.TAG, pos)

    def _calls_at(self, text: str, start: int, finished: bool) -> tuple[int, list[FunctionCall] | None] | None:
        """Where what starts at `start` ends and its calls (None: not calls); None: undecided."""
        raise NotImplementedError

    def _closing(self, text: str, opening: int, finished: bool) -> int | None:
        """Where the bracket at `opening` closes, or the end of an output that ended first; None: undecided."""
        end = self._brackets.end(text, opening)
        return len(text) if end is None and finished else end


class HermesToolParser(ToolParser):
    TAG, END = "<tool_call>", "</tool_call>"

    def _calls_at(self, text: str, start: int, finished: bool) -> tuple[int, list[FunctionCall] | None] | None:
        end = text.find(self.END, start)
        if end < 0 and not finished:
            return None
        body_end = len(text) if end < 0 else end  # unclosed at the end of the output: up to the end
        call = _function_call(_json(text[start + len(self.TAG):body_end]))
        return (body_end if end < 0 else end + len(self.END)), (None if call is None else [call])


class Llama3JsonToolParser(ToolParser):
    TAG = "<|python_tag|>"
    SEPARATOR = re.compile(r"\s*;")

    def __init__(self) -> None:
        super().__init__()
        self._after_call = False  # the text starts right after a call: a ";" there separates the next

    def _skip(self, text: str, pos: int, finished: bool) -> int | None:
        if not self._after_call:
            return pos
        if not finished and not text[pos:].strip():
            return None  # whitespace: a ";" may follow
        self._after_call = False
        separator = self.SEPARATOR.match(text, pos)
        return pos if separator is None else separator.end()

    def _opening(self, text: str, pos: int) -> int:
        brace = text.find("{", pos)
        tag = text.find(self.TAG, pos, len(text) if brace < 0 else brace)  # the tag holds no "{"
        return tag if tag >= 0 else brace

    def _calls_at(self, text: str, start: int, finished: bool) -> tuple[int, list[FunctionCall] | None] | None:
        opening = start
        if text.startswith(self.TAG, start):
            opening = _SPACE.match(text, start + len(self.TAG)).end()
            if opening == len(text) and not finished:
                return None
            if opening == len(text) or text[opening] != "{":
                return start + len(self.TAG), None  # the tag opens no JSON call
        end = self._closing(text, opening, finished)
        if end is None:
            return None
        value = _json(text[opening:end])
        call = _function_call(value) if isinstance(value, dict) and _ARGUMENT_KEYS & value.keys() else None
        self._after_call = call is not None
        return end, None if call is None else [call]


class MistralToolParser(ToolParser):
    TAG = "[TOOL_CALLS]"
    KEEPS_SPECIAL_TOKENS = True  # [TOOL_CALLS] is one of Mistral's control tokens
    NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a call written name{arguments} (tokenizers v11 and on)
    ID_CHARACTERS = string.ascii_letters + string.digits

    def _calls_at(self, text: str, start: int, finished: bool) -> tuple[int, list[FunctionCall] | None] | None:
        opening = _SPACE.match(text, start + len(self.TAG)).end()
        name = self.NAME.match(text, opening)
        if name is not None:  # name{arguments}: the arguments open right after the name
            opening = name.end()
        if opening == len(text) and not finished:
            return None
        if opening == len(text) or text[opening] != ("{" if name else "["):
            return start + len(self.TAG), None  # the tag opens no calls
        end = self._closing(text, opening, finished)
        if end is None:
            return None
        return end, self._calls(name.group() if name else None, _json(text[opening:end]))

    @staticmethod
    def _calls(name: str | None, value: Any) -> list[FunctionCall] | None:
        if name is not None:
            return None if not isinstance(value, dict) else [
                FunctionCall(name=name, arguments=json.dumps(value, ensure_ascii=False))]
        if not isinstance(value, list) or not value:
            return None
        calls = [_function_call(item) for item in value]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]

    @classmethod
    def call_id(cls) -> str:
        """Mistral's: 9 letters and digits (its templates refuse any other)."""
        return "".join(secrets.choice(cls.ID_CHARACTERS) for _ in range(9))


class PythonicToolParser(ToolParser):
    QUOTES = "'\""  # Python's

    def __init__(self) -> None:
        super().__init__()
        self._opened = False  # whether the answer's opening (a list of calls or not) is decided

    def _scan(self, text: str, finished: bool) -> Scanned:
        """Calls only as the list that opens the answer; everything after it is content."""
        if self._opened:
            return Scanned([text], len(text))
        opening = _SPACE.match(text).end()
        if opening == len(text) and not finished:
            return Scanned([], 0)
        if opening < len(text) and text[opening] == "[":
            end = self._closing(text, opening, finished)
            if end is None:
                return Scanned([], 0)
            calls = _python_calls(text[opening:end])
            if calls is not None:
                self._opened = True
                return Scanned([text[:opening], *calls, text[end:]], len(text))
        self._opened = True
        return Scanned([text], len(text))


_SPACE = re.compile(r"\s*")
_STRUCTURE = re.compile(r"[][(){}\"'\\]")


class BracketScan:
    """Where a bracket closes (the index after it), skipping strings delimited by `quotes`; None
    while it does not close within the text. Brackets of any kind nest alike: whether they match is
    the JSON or Python parser's to say. Resumable: a call held over many deltas is scanned once, so
    a stream costs time linear in its length however long an unclosed bracket holds it."""

    def __init__(self, quotes: str) -> None:
        self.quotes = quotes
        # (start, where to resume, depth, the open string's quote, the index a backslash escapes)
        self._state: tuple[int, int, int, str | None, int] | None = None

    def reset(self) -> None:
        """The text's start moved (a stream consumed some of it): indices of before mean nothing now."""
        self._state = None

    def end(self, text: str, start: int) -> int | None:
        resume, depth, quote, escaped_at = start, 0, None, -1
        if self._state is not None and self._state[0] == start:
            _, resume, depth, quote, escaped_at = self._state
        for m in _STRUCTURE.finditer(text, resume):
            char = m.group()
            if m.start() == escaped_at:
                continue  # the character a backslash in a string escapes
            if quote is not None:
                if char == "\\":
                    escaped_at = m.end()
                elif char == quote:
                    quote = None
            elif char in self.quotes:
                quote = char
            elif char in "[({":
                depth += 1
            elif char in "])}":
                depth -= 1
                if depth == 0:
                    self._state = None
                    return m.end()
        self._state = (start, len(text), depth, quote, escaped_at)
        return None


_ARGUMENT_KEYS = {"arguments", "parameters"}


def _json(text: str) -> Any:
    """The JSON value `text` holds, None when it holds none (a nesting too deep to read is none)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _function_call(value: Any) -> FunctionCall | None:
    """{"name": ..., "arguments" (or "parameters"): {...} or its JSON text} as a call; None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return FunctionCall(name=value["name"], arguments=arguments if isinstance(arguments, str)
                        else json.dumps(arguments, ensure_ascii=False))


def _python_calls(text: str) -> list[FunctionCall] | None:
    """`[f(a=1), g(b='x')]` as calls: names, keyword arguments whose values are literals. None for
    anything else (a positional argument, an expression, a value JSON cannot hold)."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for call in tree.elts:
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
            return None
        if any(k.arg is None for k in call.keywords):  # **kwargs
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
            calls.append(FunctionCall(name=call.func.id,
                                      arguments=json.dumps(arguments, ensure_ascii=False, allow_nan=False)))
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None  # not a literal, or one JSON cannot hold (a set, bytes, infinity)
    return calls


def _partial_prefix(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
                                             "mistral": MistralToolParser, "pythonic": PythonicToolParser}
assert set(TOOL_PARSERS) == set(TOOL_CALL_PARSERS), "--tool-call-parser's choices are this registry's names"
