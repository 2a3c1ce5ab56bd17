"""/v1/chat/completions: processor deltas to a `chat.completion` response or its stream of chunks.

The stream opens with one chunk per choice carrying the role and empty content (with `echo`, a
chunk with the echoed content follows), then content deltas; each choice's last chunk carries its
finish_reason; with `stream_options.include_usage` a usage chunk with `choices: []` follows (and with
`continuous_usage_stats` each chunk carries its choice's usage so far). With vLLM's
`return_token_ids` the response carries the prompt's ids (`prompt_token_ids`; streamed, on each role
chunk only) and each choice its generated ids (`token_ids`; streamed, each delta chunk's new ones).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from services.common.clients import ChoiceDelta, GenerateRequest
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
    ChatTokenLogprob,
    DeltaMessage,
    now,
)
from services.gateway.tool_calls import finish_reason_with_calls, tool_call_messages, tool_call_reader


def generate_request(body: ChatCompletionRequest, request_id: str, params: SamplingParams) -> GenerateRequest:
    try:
        messages = [m.to_template() for m in body.messages]
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    # vLLM hands tools (with tool_choice "none": they are never called) and documents to the template.
    template_inputs = {name: value for name, value in (("tools", body.tools), ("documents", body.documents))
                       if value is not None}
    return GenerateRequest(
        request_id=request_id, params=params, messages=messages,
        add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message,
        chat_template_kwargs={**(body.chat_template_kwargs or {}), **template_inputs}, priority=body.priority,
        cache_salt=body.cache_salt, truncate_prompt_tokens=body.truncate_prompt_tokens,
        truncate_right=body.truncation_side == "right", use_beam_search=body.use_beam_search,
        length_penalty=body.length_penalty,
    )


def token_logprobs(request: ChatCompletionRequest, choice: ChoiceDelta) -> list[ChatTokenLogprob]:
    """The logprobs entries of `choice`'s new tokens, as `request` asks for them (ids as tokens,
    explicit ids)."""
    return chat_logprobs(choice, bool(request.return_tokens_as_token_ids), request.logprob_token_ids is not None)


def _prompt_ids(generation: Generation, request: ChatCompletionRequest) -> list[int] | None:
    return generation.first(0).prompt_token_ids if request.return_token_ids else None


def echoed(request: ChatCompletionRequest) -> str:
    """What `echo` puts before the answer: the last message's text, if it has the answer's role (vLLM)."""
    last = request.messages[-1]
    if not request.echo or last.role != request.role:
        return ""
    return last.to_template().get("content") or ""


async def chat_response(generation: Generation, request: ChatCompletionRequest, response_id: str,
                        model: str, tool_parser: str | None = None) -> ChatCompletionResponse:
    prefix = echoed(request)
    choices = [ChatCompletionChoice(index=i, message=AssistantMessage(role=request.role, content=prefix),
                                    logprobs=ChatChoiceLogprobs(content=[]) if request.logprobs else None,
                                    token_ids=[] if request.return_token_ids else None)
               for i in range(request.n)]
    prompt_lps = None
    async for _, delta in generation.deltas():
        if request.prompt_logprobs is not None and delta.prompt_logprob_tokens:
            prompt_lps = prompt_logprobs(delta)
        for c in delta.choices:
            choice = choices[c.index]
            choice.message.content += c.text
            if choice.token_ids is not None:
                choice.token_ids += c.token_ids
            if choice.logprobs is not None:
                choice.logprobs.content.extend(token_logprobs(request, c))
            if c.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
    read_tool_calls(request, choices, tool_parser)
    return ChatCompletionResponse(id=response_id, model=model, choices=choices, usage=generation.usage(),
                                  prompt_logprobs=prompt_lps, prompt_token_ids=_prompt_ids(generation, request))


def read_tool_calls(request: ChatCompletionRequest, choices: list[ChatCompletionChoice],
                    tool_parser: str | None) -> None:
    """The calls in each finished choice's text, into its message's tool_calls (services/gateway/tool_calls.py)."""
    reader = tool_call_reader(request, tool_parser)
    for choice in choices if reader is not None else ():
        choice_reader = reader()
        parsed = choice_reader.parse(choice.message.content)
        if parsed.calls:
            choice.message.content = parsed.content
            choice.message.tool_calls = tool_call_messages(parsed.calls, choice_reader.call_id)
            choice.finish_reason = finish_reason_with_calls(request, choice.finish_reason)


async def chat_chunks(generation: Generation, request: ChatCompletionRequest, response_id: str,
                      model: str, tool_parser: str | None = None) -> AsyncIterator[ChatCompletionChunk]:
    created = now()
    continuous = request.continuous_usage_stats

    def chunk(choice: ChatStreamChoice, **extras: list[int] | None) -> ChatCompletionChunk:
        # vLLM's continuous usage is the chunk's choice's: the prompt's tokens and its own so far.
        usage = generation.choice_usage(0, choice.index) if continuous else None
        return ChatCompletionChunk(id=response_id, created=created, model=model, choices=[choice], usage=usage,
                                   **extras)

    reader = tool_call_reader(request, tool_parser)
    readers = [reader() for _ in range(request.n)] if reader is not None else None
    readers_called = [False] * request.n  # whether a choice's stream has made a call
    prefix = echoed(request)
    prompt_ids = _prompt_ids(generation, request)
    for i in range(request.n):
        yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role=request.role, content="")),
                    prompt_token_ids=prompt_ids)
        if prefix:
            yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(content=prefix)))
    async for _, delta in generation.deltas():
        for c in delta.choices:
            if not (c.text or c.finish_reason or c.logprobs or (request.return_token_ids and c.token_ids)):
                continue
            logprobs = ChatChoiceLogprobs(content=token_logprobs(request, c)) if request.logprobs else None
            message = DeltaMessage(content=c.text) if c.text else DeltaMessage()
            finish_reason = c.finish_reason
            if readers is not None:
                piece = readers[c.index].feed(c.text, c.finish_reason is not None)
                message = DeltaMessage(content=piece.content or None, tool_calls=piece.calls or None)
                readers_called[c.index] |= bool(piece.calls)
                if readers_called[c.index]:
                    finish_reason = finish_reason_with_calls(request, finish_reason)
            yield chunk(ChatStreamChoice(index=c.index, delta=message, logprobs=logprobs, finish_reason=finish_reason,
                                         stop_reason=c.stop_reason,
                                         token_ids=c.token_ids if request.return_token_ids else None))
    if request.include_usage:
        yield ChatCompletionChunk(id=response_id, created=created, model=model, choices=[], usage=generation.usage())
