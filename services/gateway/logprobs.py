"""Logprobs in OpenAI's and vLLM's shapes, from the processor's deltas.

The processor sends, per token, a `TokenLogprobs` (column 0 the token itself, then the top-N) and
the text of each column's token id (the gateway has no tokenizer):

    completions  tokens / token_logprobs / top_logprobs (token text -> logprob, the token itself
                 included) / text_offset; echoed prompt tokens first, the first of them without logprobs
    chat         content entries {token, logprob, bytes, top_logprobs: the top-N only}
    prompt       vLLM's prompt_logprobs: per prompt token {token id: {logprob, rank, decoded_token}},
                 None for the first

A logprob of -inf (a token the sampler ruled out) is written as -9999.0, as vLLM does: JSON has no
infinity and OpenAI's clients expect a number. With `as_ids` (vLLM's return_tokens_as_token_ids) a
token is written "token_id:N" in place of its text, so that one that is not valid text is still known.
With vLLM's logprob_token_ids the columns after the sampled token are the ids asked for, and chat lists
every column (the sampled token first, once) where it would list the top-N.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from services.common.clients import ChoiceDelta, GenerateDelta
from services.common.model_runner_output import TokenLogprobs
from services.gateway.protocol import ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs, Logprob, PromptLogprobs

MIN_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class TokenEntry(NamedTuple):
    """One token of a completion's logprobs; `logprob` and `top` are None for the first prompt token."""

    text: str
    logprob: float | None
    top: dict[str, float] | None


def token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


def _texts(lp: TokenLogprobs, texts: Sequence[str], as_ids: bool) -> Sequence[str]:
    return [token_id_text(t) for t in lp.token_ids] if as_ids else texts


def _entry(lp: TokenLogprobs, texts: Sequence[str], num_columns: int) -> TokenEntry:
    top: dict[str, float] = {}
    for text, logprob in zip(texts[:num_columns], lp.logprobs[:num_columns]):
        top.setdefault(text, finite(logprob))  # the token itself first, then the top-N
    return TokenEntry(texts[0], finite(lp.logprobs[0]), top)


def output_entries(choice: ChoiceDelta, as_ids: bool = False) -> list[TokenEntry]:
    return [_entry(lp, _texts(lp, texts, as_ids), len(texts))
            for lp, texts in zip(choice.logprobs, choice.logprob_tokens)]


def prompt_entries(delta: GenerateDelta, num_top: int, as_ids: bool = False) -> list[TokenEntry]:
    """The echoed prompt's entries: its first token has no logprobs; the others' top-N are cut to
    `num_top` (the prompt logprobs may have been asked for with a larger N)."""
    first = delta.prompt_logprob_tokens[0][0]
    if as_ids:
        assert delta.prompt_token_ids, "the first delta carries the prompt's ids"
        first = token_id_text(delta.prompt_token_ids[0])
    entries = [TokenEntry(first, None, None)]
    entries.extend(_entry(lp, _texts(lp, texts, as_ids), num_top + 1)
                   for lp, texts in zip(delta.prompt_logprobs[1:], delta.prompt_logprob_tokens[1:]))
    return entries


def completion_logprobs(entries: Iterable[TokenEntry], offset: int = 0) -> tuple[CompletionLogprobs, int]:
    """OpenAI's completion logprobs of `entries`, whose text starts `offset` characters into the
    choice's text; and the offset after them."""
    logprobs = CompletionLogprobs()
    for entry in entries:
        logprobs.tokens.append(entry.text)
        logprobs.token_logprobs.append(entry.logprob)
        logprobs.top_logprobs.append(entry.top)
        logprobs.text_offset.append(offset)
        offset += len(entry.text)
    return logprobs, offset


def extend(logprobs: CompletionLogprobs, more: CompletionLogprobs) -> None:
    logprobs.tokens.extend(more.tokens)
    logprobs.token_logprobs.extend(more.token_logprobs)
    logprobs.top_logprobs.extend(more.top_logprobs)
    logprobs.text_offset.extend(more.text_offset)


def chat_logprobs(choice: ChoiceDelta, as_ids: bool = False, explicit: bool = False) -> list[ChatTokenLogprob]:
    """One entry per new token: the sampled token, then its top-N alternatives; with `explicit`
    (logprob_token_ids) the sampled token and the ids asked for, each id once."""
    entries = []
    for lp, texts in zip(choice.logprobs, choice.logprob_tokens):
        texts = _texts(lp, texts, as_ids)
        columns = list(zip(lp.token_ids, texts, lp.logprobs))
        if explicit:  # the sampled token may be one of the ids asked for: each id once, first place kept
            firsts = {token_id: i for i, (token_id, _, _) in reversed(list(enumerate(columns)))}
            columns = [columns[i] for i in sorted(firsts.values())]
        else:
            columns = columns[1:]
        top = [ChatTopLogprob(token=t, logprob=finite(l), bytes=list(t.encode())) for _, t, l in columns]
        entries.append(ChatTokenLogprob(token=texts[0], logprob=finite(lp.logprobs[0]),
                                        bytes=list(texts[0].encode()), top_logprobs=top))
    return entries


def prompt_logprobs(delta: GenerateDelta) -> PromptLogprobs:
    """vLLM's prompt_logprobs of the delta that carries them."""
    out: PromptLogprobs = [None]
    for lp, texts in zip(delta.prompt_logprobs[1:], delta.prompt_logprob_tokens[1:]):
        position: dict[str, Logprob] = {}
        for j, (token_id, logprob, text) in enumerate(zip(lp.token_ids, lp.logprobs, texts)):
            position.setdefault(str(token_id), Logprob(logprob=finite(logprob), rank=lp.rank if j == 0 else j,
                                                       decoded_token=text))
        out.append(position)
    return out
