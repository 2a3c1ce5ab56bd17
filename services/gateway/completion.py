"""/v1/completions: processor deltas to a `text_completion` response or its stream of chunks.

Choice `i` of prompt `p` is choice `p * n + i` of the response, as OpenAI numbers them. With `echo`
each choice starts with its prompt (and, with `logprobs`, the prompt tokens' logprobs, the first
token's None); `echo` with `max_tokens` 0 answers the prompt alone. With vLLM's `return_token_ids`
each choice carries its prompt's ids (`prompt_token_ids`; streamed, in the choice's first chunk) and
its generated ids (`token_ids`; streamed, each chunk's new ones).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from services.common.clients import GenerateDelta, GenerateRequest
from services.common.sampling_params import SamplingParams
from services.gateway.generation import Generation
from services.gateway.logprobs import completion_logprobs, extend, output_entries, prompt_entries, prompt_logprobs
from services.gateway.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    now,
)


def generate_requests(body: CompletionRequest, request_id: str, params: SamplingParams) -> list[GenerateRequest]:
    """One processor request per prompt: `request_id` for a single prompt, else `{request_id}-p{i}`;
    all in the group `request_id` (the engine shares itself fairly between groups)."""
    prompts = body.prompts()
    return [
        GenerateRequest(
            request_id=request_id if len(prompts) == 1 else f"{request_id}-p{i}", params=params,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=None if isinstance(prompt, str) else prompt,
            add_special_tokens=body.add_special_tokens, priority=body.priority, cache_salt=body.cache_salt,
            truncate_prompt_tokens=body.truncate_prompt_tokens, truncate_right=body.truncation_side == "right",
            echo=body.echo, group_id=request_id, use_beam_search=body.use_beam_search,
            length_penalty=body.length_penalty,
        )
        for i, prompt in enumerate(prompts)
    ]


def _echo(request: CompletionRequest, delta: GenerateDelta) -> tuple[str, CompletionLogprobs | None, int]:
    """A choice's opening from its prompt's first delta: (text, logprobs, text offset after them)."""
    if not request.echo:
        return "", CompletionLogprobs() if request.logprobs is not None else None, 0
    text = delta.prompt_text or ""
    if request.logprobs is None:
        return text, None, len(text)
    logprobs, offset = completion_logprobs(prompt_entries(delta, request.logprobs, request.return_tokens_as_token_ids))
    return text, logprobs, offset


async def completion_response(generation: Generation, request: CompletionRequest, response_id: str,
                              model: str) -> CompletionResponse:
    n = request.n
    choices: list[CompletionChoice | None] = [None] * (generation.num_prompts * n)
    offsets = [0] * len(choices)
    firsts: dict[int, GenerateDelta] = {}  # per prompt: its first delta (the prompt's text and logprobs)
    async for p, delta in generation.deltas():
        first = firsts.setdefault(p, delta)
        for c in delta.choices:
            index = p * n + c.index
            choice = choices[index]
            if choice is None:
                text, logprobs, offsets[index] = _echo(request, first)
                choice = choices[index] = CompletionChoice(index=index, text=text, logprobs=logprobs)
                if request.return_token_ids:
                    choice.prompt_token_ids, choice.token_ids = first.prompt_token_ids, []
            if not request.echo_only:
                choice.text += c.text
                if choice.token_ids is not None:
                    choice.token_ids += c.token_ids
                if choice.logprobs is not None:
                    more, offsets[index] = completion_logprobs(output_entries(c, request.return_tokens_as_token_ids),
                                                               offsets[index])
                    extend(choice.logprobs, more)
            if c.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
    for index, choice in enumerate(choices):
        assert choice is not None, f"choice {index} got no output"
        if request.prompt_logprobs is not None:
            choice.prompt_logprobs = prompt_logprobs(firsts[index // n])
    return CompletionResponse(id=response_id, model=model, choices=choices, usage=generation.usage())


async def completion_chunks(generation: Generation, request: CompletionRequest, response_id: str,
                            model: str) -> AsyncIterator[CompletionChunk]:
    n, created = request.n, now()
    offsets: dict[int, int] = {}  # per choice that has started: the length of its text so far
    firsts: dict[int, GenerateDelta] = {}
    async for p, delta in generation.deltas():
        first = firsts.setdefault(p, delta)
        for c in delta.choices:
            index = p * n + c.index
            text, logprobs, prompt_ids = "", None, None
            if index not in offsets:
                text, logprobs, offsets[index] = _echo(request, first)
                prompt_ids = first.prompt_token_ids if request.return_token_ids else None
            token_ids = [] if request.echo_only else c.token_ids
            if not request.echo_only:
                text += c.text
                if request.logprobs is not None:
                    more, offsets[index] = completion_logprobs(output_entries(c, request.return_tokens_as_token_ids),
                                                               offsets[index])
                    logprobs = more if logprobs is None else _joined(logprobs, more)
            if not (text or c.finish_reason or (logprobs and logprobs.tokens) or prompt_ids
                    or (request.return_token_ids and token_ids)):
                continue
            # vLLM's continuous usage is the chunk's choice's: its prompt's tokens and its own so far.
            usage = generation.choice_usage(p, c.index) if request.continuous_usage_stats else None
            yield CompletionChunk(id=response_id, created=created, model=model, usage=usage, choices=[
                CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
                                 stop_reason=c.stop_reason, prompt_token_ids=prompt_ids,
                                 token_ids=token_ids if request.return_token_ids else None)])
    if request.include_usage:
        yield CompletionChunk(id=response_id, created=created, model=model, choices=[], usage=generation.usage())


def _joined(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    extend(first, second)
    return first
