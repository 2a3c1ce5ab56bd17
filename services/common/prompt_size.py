"""The size of a prompt before it is tokenized: what cannot fit the context is refused unread.

Tokenizing (and rendering a chat template) costs time and memory in proportion to the text, so a
prompt is measured in characters first. A token covers at most `max_token_chars` characters of
text (the longest token of the vocabulary; byte-level pieces of one character only add tokens),
so a text of more than `max_model_len * max_token_chars` characters has more tokens than the
context holds, and is refused without tokenizing it. Chat messages count the characters of
everything in them (content, names, tool calls; numbers as JSON writes them, one per entry of an
object or array) and of the template's extra inputs (tools, documents); a template writes
at least one token per message, so there may be no more messages than the context has tokens.

Both the gateway (with a generous `max_token_chars`, before the request travels) and the processor
(with its vocabulary's own, because it trusts no caller) check it; the work one request can cause
the tokenizer is then bounded, and a request whose client went away frees its thread in bounded time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple


class PromptSize(NamedTuple):
    chars: int  # characters of every string the prompt (or its chat template) is made of
    messages: int  # chat messages (0 for a text prompt)


def text_chars(value: Any) -> int:
    """Characters `value` (JSON: strings, numbers, objects, arrays) brings to a template, without
    recursion: every string (keys included), every number and literal as JSON writes it, and one
    per entry of an object or array. Counting strings alone would let a template that writes its
    inputs with `tojson` render megabytes of numbers (or empty arrays) counted as nothing."""
    total, pending = 0, [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, bool) or item is None:
            total += 5 if item is False else 4
        elif isinstance(item, (int, float)):
            # An int's digits from its bits: str() of a huge int is slow, and refused past 4300 digits.
            total += len(repr(item)) if isinstance(item, float) else item.bit_length() * 30103 // 100000 + 1
        elif isinstance(item, Mapping):
            total += len(item)  # a separator per entry
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            total += len(item)
            pending.extend(item)
    return total


def prompt_size(prompt: str | None, messages: Sequence[Mapping[str, Any]] | None,
                template_inputs: Iterable[Any] = ()) -> PromptSize:
    """The size of a text prompt, or of chat messages with the template's other inputs."""
    if prompt is not None:
        return PromptSize(len(prompt), 0)
    messages = messages or ()
    return PromptSize(text_chars(list(messages)) + sum(text_chars(v) for v in template_inputs), len(messages))


def check_prompt_size(size: PromptSize, max_model_len: int, max_token_chars: int, flag: str = "") -> None:
    """ValueError naming the limit when `size` cannot fit `max_model_len` tokens (module docstring)."""
    max_chars = max_model_len * max_token_chars
    how = f" ({flag})" if flag else ""
    if size.chars > max_chars:
        raise ValueError(f"the prompt has {size.chars} characters, more than the {max_chars} that can fit this "
                         f"model's context of {max_model_len} tokens at {max_token_chars} characters per token{how}")
    if size.messages > max_model_len:
        raise ValueError(f"the request has {size.messages} messages, more than this model's context of "
                         f"{max_model_len} tokens can hold")
