"""What one request may ask of the server: body size, prompts, choices and sequences, logprobs,
stop strings, token-id lists, tokens, the answer's size, a prompt's characters (services.common.config.Limits, built
at the edge from flags); a request over a limit is a 400 that names the limit and its flag.

The body size is checked by an ASGI middleware as the body streams in (a client announcing or
sending more than the limit is refused without the rest being read); the prompt's characters
against the context length by `check_prompt_sizes`; the token-id lists by `check_token_id_lists`
before the gateway turns the request into SamplingParams; everything else by `check_limits` after.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.config import Limits, flag_of
from services.common.prompt_size import PromptSize, check_prompt_size
from services.common.sampling_params import WHOLE_VOCABULARY, SamplingParams
from services.gateway.batch_chat import BatchChatCompletionRequest
from services.gateway.errors import APIError, bad_request
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest


def check_limits(limits: Limits, body: SamplingRequest, params: SamplingParams,
                 max_model_len: int | None = None) -> SamplingParams:
    """`params` (made from `body`) within the limits: APIError (400) for what is over one;
    max_tokens, when the request left it open, what the limits leave (None, the rest of the
    context, when they leave at least `max_model_len`; the engine caps any at the rest)."""
    if isinstance(body, BatchChatCompletionRequest):
        num_prompts, prompts_param = len(body.messages), "messages"  # its conversations
    else:
        num_prompts, prompts_param = len(body.prompts()) if isinstance(body, CompletionRequest) else 1, "prompt"
    _at_most(num_prompts, limits.max_prompts, "prompts", prompts_param, "max_prompts")
    _at_most(params.n, limits.max_n, "n", "n", "max_n")
    _at_most(num_prompts * params.n, limits.max_sequences_per_request, "sequences (prompts x n)", "n",
             "max_sequences_per_request")
    logprobs_param = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
    for name, value in ((logprobs_param, params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
        if value is None or limits.max_logprobs == WHOLE_VOCABULARY:  # no limit: the processor checks the vocabulary
            continue
        if value == WHOLE_VOCABULARY:
            raise APIError(400, f"{name} -1 (the whole vocabulary) is over this server's limit of "
                                f"{limits.max_logprobs} ({flag_of(Limits, 'max_logprobs')}; -1 there allows it)",
                           "invalid_request_error", name, "limit_exceeded")
        _at_most(value, limits.max_logprobs, name, name, "max_logprobs")
    _at_most(len(params.stop), limits.max_stop_strings, "stop strings", "stop", "max_stop_strings")
    for stop in params.stop:
        _at_most(len(stop), limits.max_stop_string_length, "characters in a stop string", "stop",
                 "max_stop_string_length")
    given = sorted({"max_tokens", "max_completion_tokens"} & body.model_fields_set)
    left_open = not given or params.max_tokens is None  # the endpoint's default, or the rest of the context
    if not left_open and limits.max_tokens is not None:
        _at_most(params.max_tokens, limits.max_tokens, given[0], given[0], "max_tokens")
    return _within_answer_budget(limits, params, num_prompts * params.n, given[0] if given else "max_tokens",
                                 left_open, max_model_len)


def _within_answer_budget(limits: Limits, params: SamplingParams, num_choices: int, tokens_param: str,
                          left_open: bool, max_model_len: int | None) -> SamplingParams:
    """`params` whose answer fits --max-answer-tokens: every choice's tokens, each top logprob counted
    as one more. A max_tokens the request left open becomes at most what fits and --max-tokens-limit;
    one it set over what fits is a 400."""
    if params.logprobs == WHOLE_VOCABULARY:  # allowed by --max-logprobs -1: the operator lifted this bound
        return params
    per_token = num_choices * (1 + (params.logprobs or 0))
    fits = limits.max_answer_tokens // per_token
    budget = flag_of(Limits, "max_answer_tokens")
    if fits < 1:
        raise APIError(400, f"{num_choices} choices with {params.logprobs or 0} top logprobs each cannot produce one "
                            f"token within this server's answer limit of {limits.max_answer_tokens} tokens ({budget}: "
                            "choices x max_tokens x (1 + top logprobs))", "invalid_request_error", "n", "limit_exceeded")
    if left_open:
        caps = [c for c in (params.max_tokens, fits, limits.max_tokens) if c is not None]
        if params.max_tokens is None and max_model_len is not None and min(caps) >= max_model_len:
            return params  # the context binds first: it stays open
        return replace(params, max_tokens=min(caps))
    if params.max_tokens > fits:
        raise APIError(400, f"max_tokens {params.max_tokens} for {num_choices} choices with {params.logprobs or 0} top "
                            f"logprobs each is over this server's answer limit of {limits.max_answer_tokens} tokens "
                            f"({budget}: choices x max_tokens x (1 + top logprobs)); at most {fits} fit",
                       "invalid_request_error", tokens_param, "limit_exceeded")
    return params


def check_token_id_lists(limits: Limits, body: SamplingRequest) -> None:
    """APIError (400) for a token-id list longer than its limit. Counted as sent, duplicates too, and
    before SamplingParams sorts and deduplicates them, so that an oversized list costs no more work."""
    for name, ids, limit in (("allowed_token_ids", body.allowed_token_ids, "max_allowed_token_ids"),
                             ("logit_bias", body.logit_bias, "max_logit_bias"),
                             ("stop_token_ids", body.stop_token_ids, "max_stop_token_ids")):
        _at_most(len(ids or ()), getattr(limits, limit), f"token ids in {name}", name, limit)


def check_prompt_sizes(limits: Limits, sizes: Iterable[PromptSize], max_model_len: int) -> None:
    """APIError (400) for a prompt that cannot fit `max_model_len` tokens, told from its characters
    before anything tokenizes it (services/common/prompt_size.py)."""
    for size in sizes:
        try:
            check_prompt_size(size, max_model_len, limits.max_chars_per_token, flag_of(Limits, "max_chars_per_token"))
        except ValueError as e:
            raise APIError(400, str(e), "invalid_request_error", "messages" if size.messages else "prompt",
                           "limit_exceeded") from None


def _at_most(value: int, limit: int, what: str, param: str, name: str) -> None:
    if value > limit:
        raise APIError(400, f"{value} {what} is over this server's limit of {limit} ({flag_of(Limits, name)})",
                       "invalid_request_error", param, "limit_exceeded")


class BodyLimitMiddleware:
    """Refuses a request body over `max_body_bytes` with a 400, reading at most that much of it: at
    once when Content-Length says so, else as soon as the chunks read add up to more. The body read
    is handed on whole, so the app never sees a partial one."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and not length.isdigit():
            await bad_request(f"invalid Content-Length {length!r}").response()(scope, receive, send)
            return
        if length is not None and int(length) > self.max_body_bytes:
            await self._too_large(length).response()(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                await self._too_large(f"more than {self.max_body_bytes}").response()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            # The body once, then the client's next messages (its disconnect) as they come.
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self, size: str) -> APIError:
        return APIError(400, f"the request body has {size} bytes, over this server's limit of "
                        f"{self.max_body_bytes} (--max-body-bytes)", "invalid_request_error", None, "limit_exceeded")
