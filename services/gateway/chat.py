"""/v1/chat/completions: processor deltas to a `chat.completion` response or its stream of chunks.

The stream opens with one chunk per choice carrying the role and empty content (with `echo`, a
chunk with the echoed content follows), then content deltas; each choice's last chunk carries its
finish_reason; with `stream_options.include_usage` a usage chunk with `choices: []` follows.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from services.common.clients import GenerateRequest
from services.common.sampling_params import SamplingParams
from services.gateway.errors import bad_request
from services.gateway.generation import Generation
from services.gateway.logprobs import chat_logprobs, prompt_logprobs
from services.gateway.protocol import (
    AssistantMessage,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    DeltaMessage,
    now,
)


def generate_request(body: ChatCompletionRequest, request_id: str, params: SamplingParams) -> GenerateRequest:
    try:
        messages = [m.to_template() for m in body.messages]
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    return GenerateRequest(
        request_id=request_id, params=params, messages=messages,
        add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message,
        chat_template_kwargs=body.chat_template_kwargs or {}, priority=body.priority, cache_salt=body.cache_salt,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
    )


def echoed(request: ChatCompletionRequest) -> str:
    """What `echo` puts before the answer: the last message's text, if it has the answer's role (vLLM)."""
    last = request.messages[-1]
    if not request.echo or last.role != request.role:
        return ""
    return last.to_template().get("content") or ""


async def chat_response(generation: Generation, request: ChatCompletionRequest, response_id: str,
                        model: str) -> ChatCompletionResponse:
    prefix = echoed(request)
    choices = [ChatCompletionChoice(index=i, message=AssistantMessage(role=request.role, content=prefix),
                                    logprobs=ChatChoiceLogprobs(content=[]) if request.logprobs else None)
               for i in range(request.n)]
    prompt_lps = None
    async for _, delta in generation.deltas():
        if request.prompt_logprobs is not None and delta.prompt_logprob_tokens:
            prompt_lps = prompt_logprobs(delta)
        for c in delta.choices:
            choice = choices[c.index]
            choice.message.content += c.text
            if choice.logprobs is not None:
                choice.logprobs.content.extend(chat_logprobs(c))
            if c.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
    return ChatCompletionResponse(id=response_id, model=model, choices=choices, usage=generation.usage(),
                                  prompt_logprobs=prompt_lps)


async def chat_chunks(generation: Generation, request: ChatCompletionRequest, response_id: str,
                      model: str) -> AsyncIterator[ChatCompletionChunk]:
    created = now()

    def chunk(choice: ChatStreamChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=response_id, created=created, model=model, choices=[choice], usage=usage)

    usage = generation.usage() if request.continuous_usage_stats else None
    prefix = echoed(request)
    for i in range(request.n):
        yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role=request.role, content="")))
        if prefix:
            yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(content=prefix)))
    async for _, delta in generation.deltas():
        usage = generation.usage() if request.continuous_usage_stats else None
        for c in delta.choices:
            if not (c.text or c.finish_reason or c.logprobs):
                continue
            logprobs = ChatChoiceLogprobs(content=chat_logprobs(c)) if request.logprobs else None
            message = DeltaMessage(content=c.text) if c.text else DeltaMessage()
            yield chunk(ChatStreamChoice(index=c.index, delta=message, logprobs=logprobs, finish_reason=c.finish_reason,
                                         stop_reason=c.stop_reason))
    if request.include_usage:
        yield ChatCompletionChunk(id=response_id, created=created, model=model, choices=[], usage=generation.usage())
