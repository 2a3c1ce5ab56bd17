"""/v1/chat/completions: processor deltas to a `chat.completion` response or its stream of chunks.

The stream opens with one chunk per choice carrying the role and empty content, then content
deltas; each choice's last chunk carries its finish_reason; with `stream_options.include_usage` a
usage chunk with `choices: []` follows.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from services.common.clients import ChoiceDelta
from services.gateway.generation import Generation
from services.gateway.protocol import (
    AssistantMessage,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaMessage,
    now,
)


def token_logprobs(choice: ChoiceDelta) -> list[ChatTokenLogprob]:
    """One entry per new token: the sampled token, then the top-N alternatives."""
    entries = []
    for lp, texts in zip(choice.logprobs, choice.logprob_tokens):
        top = [ChatTopLogprob(token=t, logprob=l, bytes=list(t.encode())) for t, l in zip(texts[1:], lp.logprobs[1:])]
        entries.append(ChatTokenLogprob(token=texts[0], logprob=lp.logprobs[0], bytes=list(texts[0].encode()),
                                        top_logprobs=top))
    return entries


async def chat_response(generation: Generation, request: ChatCompletionRequest, response_id: str,
                        model: str) -> ChatCompletionResponse:
    choices = [ChatCompletionChoice(index=i, message=AssistantMessage(content=""),
                                    logprobs=ChatChoiceLogprobs(content=[]) if request.logprobs else None)
               for i in range(request.n)]
    async for _, delta in generation.deltas():
        for c in delta.choices:
            choice = choices[c.index]
            choice.message.content += c.text
            if choice.logprobs is not None:
                choice.logprobs.content.extend(token_logprobs(c))
            if c.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
    return ChatCompletionResponse(id=response_id, model=model, choices=choices, usage=generation.usage())


async def chat_chunks(generation: Generation, request: ChatCompletionRequest, response_id: str,
                      model: str) -> AsyncIterator[ChatCompletionChunk]:
    created = now()

    def chunk(choice: ChatStreamChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=response_id, created=created, model=model, choices=[choice])

    for i in range(request.n):
        yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
    async for _, delta in generation.deltas():
        for c in delta.choices:
            if not (c.text or c.finish_reason or c.logprobs):
                continue
            logprobs = ChatChoiceLogprobs(content=token_logprobs(c)) if request.logprobs else None
            message = DeltaMessage(content=c.text) if c.text else DeltaMessage()
            yield chunk(ChatStreamChoice(index=c.index, delta=message, logprobs=logprobs, finish_reason=c.finish_reason,
                                         stop_reason=c.stop_reason))
    if request.include_usage:
        yield ChatCompletionChunk(id=response_id, created=created, model=model, choices=[], usage=generation.usage())
