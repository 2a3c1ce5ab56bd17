"""/v1/completions: processor deltas to a `text_completion` response or its stream of chunks.

Choice `i` of prompt `p` is choice `p * n + i` of the response, as OpenAI numbers them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from services.common.clients import ChoiceDelta
from services.gateway.generation import Generation
from services.gateway.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    now,
)


def add_logprobs(logprobs: CompletionLogprobs, choice: ChoiceDelta, offset: int) -> int:
    """Appends `choice`'s token logprobs; `offset` is the text length before them. Returns the
    offset after them. The top-logprobs map holds the sampled token first, then the top-N."""
    for lp, texts in zip(choice.logprobs, choice.logprob_tokens):
        logprobs.tokens.append(texts[0])
        logprobs.token_logprobs.append(lp.logprobs[0])
        top: dict[str, float] = {}
        for text, logprob in zip(texts, lp.logprobs):
            top.setdefault(text, logprob)
        logprobs.top_logprobs.append(top)
        logprobs.text_offset.append(offset)
        offset += len(texts[0])
    return offset


async def completion_response(generation: Generation, request: CompletionRequest, response_id: str,
                              model: str) -> CompletionResponse:
    n = request.n
    choices = [CompletionChoice(index=i, text="",
                                logprobs=CompletionLogprobs() if request.logprobs is not None else None)
               for i in range(generation.num_prompts * n)]
    offsets = [0] * len(choices)
    async for p, delta in generation.deltas():
        for c in delta.choices:
            choice = choices[p * n + c.index]
            choice.text += c.text
            if choice.logprobs is not None:
                offsets[choice.index] = add_logprobs(choice.logprobs, c, offsets[choice.index])
            if c.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
    return CompletionResponse(id=response_id, model=model, choices=choices, usage=generation.usage())


async def completion_chunks(generation: Generation, request: CompletionRequest, response_id: str,
                            model: str) -> AsyncIterator[CompletionChunk]:
    n, created = request.n, now()
    offsets = [0] * (generation.num_prompts * n)
    async for p, delta in generation.deltas():
        for c in delta.choices:
            if not (c.text or c.finish_reason or c.logprobs):
                continue
            index = p * n + c.index
            logprobs = None
            if request.logprobs is not None:
                logprobs = CompletionLogprobs()
                offsets[index] = add_logprobs(logprobs, c, offsets[index])
            yield CompletionChunk(id=response_id, created=created, model=model, choices=[CompletionChoice(
                index=index, text=c.text, logprobs=logprobs, finish_reason=c.finish_reason,
                stop_reason=c.stop_reason)])
    if request.include_usage:
        yield CompletionChunk(id=response_id, created=created, model=model, choices=[], usage=generation.usage())
