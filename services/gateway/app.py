"""The OpenAI-compatible HTTP API over a ProcessorClient (in-process or gRPC).

A client that goes away aborts its request down to the engine on both paths: Starlette cancels a
streaming response when it sees the disconnect; a non-streaming handler is not cancelled by
anything, so it races its generation against the disconnect itself (engine-pitfalls 17).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import re
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.clients import GenerateRequest, ProcessorClient
from services.common.errors import ModelNotFoundError
from services.common.lora import LoRAModule
from services.common.prompt_size import PromptSize, prompt_size
from services.common.sampling_params import SamplingParams
from services.gateway.auth import APIKeyMiddleware, tenant_of
from services.gateway.batch_chat import BatchChatCompletionRequest, batch_chat_response
from services.gateway.batch_chat import generate_requests as batch_generate_requests
from services.gateway.chat import chat_chunks, chat_response, generate_request
from services.gateway.completion import completion_chunks, completion_response, generate_requests
from services.gateway.errors import (ANSWERED_ERRORS, OPENAPI_ERRORS, APIError, api_error_of, bad_request,
                                     model_not_found)
from services.gateway.generation import Generation
from services.common.config import GatewayConfig, GrammarLimits, Limits
from services.gateway.limits import BodyLimitMiddleware, check_limits, check_prompt_sizes, check_token_id_lists
from services.gateway.metrics import GatewayMetrics, HttpMetricsMiddleware
from services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    SamplingRequest,
    ServerLoad,
    StreamOptions,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from services.gateway.sampling import to_sampling_params
from services.gateway.structured import validate_structured_outputs
from services.gateway.tokenization import to_tokenize_request
from services.gateway.tool_calls import with_parser_tokens
from services.gateway.unsupported import unsupported_asks
from services.gateway.sse import sse_stream

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
# A generating route answers JSON, or with stream=true server-sent events (each a JSON chunk or
# an error in `data`, then `data: [DONE]`).
STREAMED: dict[int | str, dict] = {200: {"content": {"text/event-stream": {"schema": {
    "type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}}}}}
DEFAULT_SESSION_HEADER: str = GatewayConfig.session_header
MAX_SESSION_ID_CHARS = 256
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away; nobody reads it
T = TypeVar("T")
S = TypeVar("S", bound=SamplingRequest)


def create_app(processor: ProcessorClient, served_model_name: str | Sequence[str], health_timeout: float = 5.0,
               limits: Limits = Limits(), api_keys: Sequence[str] = (), priority_api_keys: Sequence[str] = (),
               metrics: GatewayMetrics | None = None, *, session_header: str = DEFAULT_SESSION_HEADER,
               options: ApiOptions | None = None, grammar_limits: GrammarLimits = GrammarLimits()) -> FastAPI:
    """The gateway app. `health_timeout` bounds /health's question to the processor (seconds);
    with `api_keys`, every path but the public ones needs one of them (services/gateway/auth.py).
    /metrics serves `metrics` (default: a registry of this app's own). The `session_header`'s value
    becomes the requests' session id (the processor's `session` routing). `options`: vLLM's server
    flags the app honours (GatewayConfig). `served_model_name`: the model's name, or each served model's
    (the first is the model of requests that name none)."""
    options = options or ApiOptions()
    names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name)
    app = FastAPI(title="kvmesh", version=_version(), docs_url=None, redoc_url=None, responses=OPENAPI_ERRORS)
    # Outermost last: request id, then the key (no body of an unauthenticated client is read), then
    # the body's size, then any error of ours answered, then routing.
    app.add_middleware(answer_errors)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=limits.max_body_bytes)
    if api_keys or priority_api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys, priority_keys=priority_api_keys)
    app.add_middleware(RequestIdMiddleware, echo=options.request_id_headers)
    # Outermost of all: it counts what the ones inside refuse (401, the body-size 400) too.
    metrics = metrics or GatewayMetrics()
    app.add_middleware(HttpMetricsMiddleware, metrics=metrics, routes=app.router.routes)
    app.add_exception_handler(RequestValidationError, _validation_error)
    # The errors a request can meet are answered here; any other exception is a bug of ours and
    # goes to Starlette's last-resort handler too (a 500 in our shape, and a logged traceback).
    for kind in (*ANSWERED_ERRORS, Exception):
        app.add_exception_handler(kind, _error)
    api = app.state.api = _API(processor, names, limits, session_header, options, grammar_limits)

    @app.get("/metrics", include_in_schema=False)
    async def metrics_page() -> Response:
        return Response(await metrics.page(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health", response_class=Response)  # 200 with no body
    @app.get("/ping", response_class=Response)  # SageMaker's pair with /invocations (vLLM serves both)
    @app.post("/ping", response_class=Response)
    async def health() -> Response:
        try:
            healthy = await asyncio.wait_for(processor.is_healthy(), health_timeout)
        except (ConnectionError, TimeoutError) as e:
            # The why stays in the log: a gRPC error's details name internal addresses, and this is public.
            logger.warning("not healthy: %s", str(e) or type(e).__name__)
            healthy = False
        if healthy:
            return Response(status_code=200)
        return _error_response(503, ErrorInfo(message="not healthy: the model is not serving",
                                              type="service_unavailable", code="service_unavailable"))

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.get("/v1/models")
    async def models() -> ModelList:
        lengths = dict(zip(names, await asyncio.gather(*(api.context_length(name) for name in names))))
        # root names the model as served, not where its files lie on the engines' disks; a LoRA
        # adapter's is its folder and its parent the base model's name, as vLLM lists them.
        bases = [ModelCard(id=name, root=name, max_model_len=length) for name, length in lengths.items()]
        adapters = [ModelCard(id=name, root=module.path, parent=parent, max_model_len=lengths[parent])
                    for name, module in api.adapters.items() for parent in (api.adapter_parents[name],)]
        return ModelList(data=bases + adapters)

    @app.post("/v1/completions", responses=STREAMED)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await api.completions(body, request)

    @app.post("/v1/chat/completions", responses=STREAMED)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await api.chat_completions(body, request)

    @app.post("/v1/chat/completions/batch")
    async def batch_chat_completions(body: BatchChatCompletionRequest, request: Request) -> Response:
        return await api.batch_chat_completions(body, request)

    @app.post("/invocations", responses=STREAMED)
    async def invocations(request: Request) -> Response:
        return await api.invocations(request)

    @app.get("/load")
    async def load() -> ServerLoad:
        return ServerLoad(server_load=len(api.generations))

    if options.tokenizer_info:  # off by default, as in vLLM: it shows the chat template and more
        @app.get("/tokenizer_info")
        async def tokenizer_info() -> JSONResponse:
            return JSONResponse(await processor.tokenizer_info())

    if options.allow_runtime_lora_updating:  # off by default, as vLLM's: a 404 then
        @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
            await api.load_lora_adapter(body)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
            await api.unload_lora_adapter(body)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return _json(await api.tokenize(body))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return _json(await api.detokenize(body))

    return app


@dataclass(frozen=True)
class ApiOptions:
    """vLLM's server flags the app itself honours (GatewayConfig's fields of the same names)."""

    request_id_headers: bool = False  # X-Request-Id on every response
    force_include_usage: bool = False  # usage on every stream chunk, and a usage chunk last
    tokenizer_info: bool = False  # GET /tokenizer_info
    return_tokens_as_token_ids: bool = False  # the default of the request field of that name
    tool_call_parser: str | None = None  # with tool_choice "auto" (None: "auto" is refused)
    cache_salt_per_api_key: bool = False  # every request's cache_salt starts with its key's hash
    lora_modules: tuple[LoRAModule, ...] = ()  # LoRA adapters: requests may name them as their model
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter

    @classmethod
    def of(cls, gateway: GatewayConfig) -> ApiOptions:
        return cls(gateway.enable_request_id_headers, gateway.enable_force_include_usage,
                   gateway.enable_tokenizer_info_endpoint, gateway.return_tokens_as_token_ids,
                   gateway.tool_call_parser if gateway.enable_auto_tool_choice else None,
                   gateway.cache_salt_per_api_key)


def _set_tenant(requests: list[GenerateRequest], request: Request, body: SamplingRequest,
                salt_per_key: bool = False) -> None:
    """Every request's tenant, the hash its API key names (services/gateway/auth.py); 403 for a
    `priority` its key may not set. With `salt_per_key`, the tenant's hash leads every request's
    cache_salt (the client's own salt after it): only requests of one key share cached blocks."""
    tenant = tenant_of(request.scope)
    if body.priority and not tenant.may_set_priority:
        raise APIError(403, f"priority {body.priority} is refused: only the keys of --priority-api-key-file may set "
                            "priority", "invalid_request_error", "priority", "priority_not_allowed")
    for r in requests:
        r.tenant_id = tenant.id
        if salt_per_key and tenant.id is not None:
            # The hash, never the key: the salt reaches the engines and their block hashes.
            r.cache_salt = f"key:{tenant.id}" if r.cache_salt is None else f"key:{tenant.id}:{r.cache_salt}"


class _API:
    """The generating endpoints: request → processor requests → a response or an SSE stream."""

    def __init__(self, processor: ProcessorClient, served_model_names: Sequence[str], limits: Limits,
                 session_header: str = DEFAULT_SESSION_HEADER, options: ApiOptions | None = None,
                 grammar_limits: GrammarLimits = GrammarLimits()) -> None:
        assert served_model_names, "a gateway serves at least one model"
        self.processor = processor
        self.served_model_names = tuple(served_model_names)  # the first: the model of requests naming none
        self.limits = limits
        self.grammar_limits = grammar_limits
        self.session_header = session_header
        self.options = options or ApiOptions()
        self.adapters = {m.name: m for m in self.options.lora_modules}
        self.adapter_parents = {m.name: m.base_model_name or self.served_model_names[0]
                                for m in self.options.lora_modules}
        self.max_model_lens: dict[str, int] = {}  # each model's context length, once asked
        # In flight, from their first delta to their last byte: /load's count (vLLM's server_load).
        self.generations: set[Generation] = set()

    async def invocations(self, request: Request) -> Response:
        """SageMaker's one route: a chat completion's body (it has `messages`) or a completion's
        (`prompt`), answered as its own route answers it."""
        try:
            body = await request.json()
        except ValueError as e:
            raise bad_request(f"the body is not valid JSON: {e}") from None
        if isinstance(body, dict) and "messages" in body:
            kind, route = ChatCompletionRequest, self.chat_completions
        elif isinstance(body, dict) and "prompt" in body:
            kind, route = CompletionRequest, self.completions
        else:
            raise bad_request("Cannot find suitable handler for request. Expected one of: "
                              "['ChatCompletionRequest', 'CompletionRequest'] (a JSON object with `messages` or "
                              "with `prompt`)")
        try:
            parsed = kind.model_validate(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        return await route(parsed, request)

    async def batch_chat_completions(self, body: BatchChatCompletionRequest, request: Request) -> Response:
        body = with_parser_tokens(body, self.options.tool_call_parser)
        model = self._served(body.model)
        params = await self._params(body, model)
        await self._check_sizes(model, (PromptSize(0, len(c)) for c in body.messages))  # before converting them
        response_id, engine_id = _ids("chatcmpl", request, body.request_id)
        requests = _for_model(batch_generate_requests(body, engine_id, params), model)
        self._set_session(requests, request, body)
        _set_tenant(requests, request, body, self.options.cache_salt_per_api_key)
        await self._check_sizes(model, (prompt_size(None, r.messages, r.chat_template_kwargs.values())
                                        for r in requests))
        return await self._respond(request, requests, False, _no_stream,
                                   lambda g: batch_chat_response(g, body, response_id, model,
                                                                 self.options.tool_call_parser))

    def _with_usage(self, body: S) -> S:
        """With --enable-force-include-usage, a stream's body as if it asked for usage on every chunk
        and at the end, whatever its stream_options say (vLLM's rule)."""
        if not (self.options.force_include_usage and body.stream):
            return body
        forced = StreamOptions(include_usage=True, continuous_usage_stats=True)
        return body.model_copy(update={"stream_options": forced})

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        body = self._with_usage(body)
        model = self._served(body.model)
        params = await self._params(body, model)
        await self._check_sizes(model, (prompt_size(p, None) for p in body.prompts() if isinstance(p, str)))
        response_id, engine_id = _ids("cmpl", request, body.request_id)
        requests = _for_model(generate_requests(body, engine_id, params), model)
        self._set_session(requests, request, body)
        _set_tenant(requests, request, body, self.options.cache_salt_per_api_key)
        return await self._respond(request, requests, body.stream,
                                   lambda g: completion_chunks(g, body, response_id, model),
                                   lambda g: completion_response(g, body, response_id, model))

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        body = with_parser_tokens(self._with_usage(body), self.options.tool_call_parser)
        model = self._served(body.model)
        params = await self._params(body, model)
        await self._check_sizes(model, [PromptSize(0, len(body.messages))])  # before converting each of them
        response_id, engine_id = _ids("chatcmpl", request, body.request_id)
        requests = _for_model([generate_request(body, engine_id, params)], model)
        parser = self.options.tool_call_parser
        self._set_session(requests, request, body)
        _set_tenant(requests, request, body, self.options.cache_salt_per_api_key)
        await self._check_sizes(model, [prompt_size(None, requests[0].messages,
                                                    requests[0].chat_template_kwargs.values())])
        return await self._respond(request, requests, body.stream,
                                   lambda g: chat_chunks(g, body, response_id, model, parser),
                                   lambda g: chat_response(g, body, response_id, model, parser))

    def _set_session(self, requests: list[GenerateRequest], request: Request, body: SamplingRequest) -> None:
        """The session header's value, if sent, else the body's session_id (vLLM's field), as every
        request's session id; 400 when too long."""
        session_id, where = request.headers.get(self.session_header), self.session_header
        if session_id is None:
            session_id, where = body.session_id, "session_id"
        if session_id is None:
            return
        if len(session_id) > MAX_SESSION_ID_CHARS:
            raise bad_request(f"the {where} is {len(session_id)} characters long; at most "
                              f"{MAX_SESSION_ID_CHARS} are allowed", where)
        for r in requests:
            r.session_id = session_id or None

    async def _params(self, body: SamplingRequest, model: str) -> SamplingParams:
        asked = unsupported_asks(body, auto_tools=self.options.tool_call_parser is not None)
        if asked:
            raise bad_request("; ".join(a.message for a in asked), asked[0].field)
        if body.return_tokens_as_token_ids is None:  # the request as this server reads it: its flag decides
            body.return_tokens_as_token_ids = self.options.return_tokens_as_token_ids
        check_token_id_lists(self.limits, body)
        params = check_limits(self.limits, body, to_sampling_params(body, self.grammar_limits),
                              await self.context_length(model))
        await validate_structured_outputs(body, params.structured_outputs, self.grammar_limits)  # off the loop
        return params

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> None:
        """Load it on every engine of the first model (through the processor); requests may name it
        as their model from then on. 400 for a bad folder or a name in use."""
        if body.lora_name in self.served_model_names or body.lora_name in self.adapters:
            raise bad_request(f"The lora adapter '{body.lora_name}' has already been loaded.", "lora_name")
        await self.processor.load_lora_adapter(body.lora_name, body.lora_path)
        self.adapters[body.lora_name] = LoRAModule(body.lora_name, body.lora_path)
        self.adapter_parents[body.lora_name] = self.served_model_names[0]

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> None:
        """New requests naming it get a 404 at once; those in flight finish. 404 for one not served."""
        try:
            await self.processor.unload_lora_adapter(body.lora_name)
        except ModelNotFoundError:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "NotFoundError",
                           "lora_name", 404) from None
        finally:  # gone from the processor either way
            self.adapters.pop(body.lora_name, None)
            self.adapter_parents.pop(body.lora_name, None)

    def _served(self, model: str | None) -> str:
        """The served model a request names (none: the first); 404 model_not_found for another."""
        if model is None:
            return self.served_model_names[0]
        if model not in self.served_model_names and model not in self.adapters:
            raise model_not_found(model)
        return model

    async def context_length(self, model: str) -> int:
        """`model`'s context length, asked of the processor once."""
        if model not in self.max_model_lens:
            self.max_model_lens[model] = (await self.processor.model_info(model)).max_model_len
        return self.max_model_lens[model]

    async def _check_sizes(self, model: str, sizes: Iterable[PromptSize]) -> None:
        """400 for a prompt too long to fit the context, before it travels to be tokenized."""
        check_prompt_sizes(self.limits, sizes, await self.context_length(model))

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        model = self._served(body.model)
        await self._check_sizes(model, [PromptSize(0, len(body.messages or ()))])  # before converting each of them
        request = to_tokenize_request(body)
        request.model = model
        await self._check_sizes(model, [prompt_size(request.prompt, request.messages,
                                                    request.chat_template_kwargs.values())])
        tokenized = await self.processor.tokenize(request)
        return TokenizeResponse(count=len(tokenized.token_ids), max_model_len=tokenized.max_model_len,
                                tokens=tokenized.token_ids, token_strs=tokenized.token_strs)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        model = self._served(body.model)
        # Ids count like a prompt: no more than the context holds, as each may decode to many bytes.
        if len(body.tokens) > (context_length := await self.context_length(model)):
            raise APIError(400, f"{len(body.tokens)} tokens is over the model's context length of "
                                f"{context_length} tokens", "invalid_request_error", "tokens", "limit_exceeded")
        return DetokenizeResponse(prompt=await self.processor.detokenize(body.tokens, model))

    async def _respond(
        self,
        request: Request,
        requests: list[GenerateRequest],
        stream: bool,
        chunks: Callable[[Generation], AsyncIterator],
        response: Callable[[Generation], Awaitable[BaseModel]],
    ) -> Response:
        generation = Generation.start(self.processor, requests)
        self.generations.add(generation)
        streaming = False
        try:
            # Wait for the first deltas: invalid input is then a status code, not an error event.
            if await until_disconnected(request, generation.started()) is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            if stream:
                streaming = True  # the stream closes the generation
                return StreamingResponse(self._streamed(generation, chunks(generation)),
                                         media_type="text/event-stream")
            body = await until_disconnected(request, response(generation))
            return Response(status_code=CLIENT_CLOSED_REQUEST) if body is None else _json(body)
        finally:
            if not streaming:
                await self._close(generation)

    async def _streamed(self, generation: Generation, chunks: AsyncIterator) -> AsyncIterator[str]:
        try:
            async for line in sse_stream(chunks):
                yield line
        finally:
            await self._close(generation)

    async def _close(self, generation: Generation) -> None:
        self.generations.discard(generation)
        await generation.aclose()

    def end_all(self, reason: str) -> int:
        """Ends every request in flight with a 503 (or, streaming, an error event); their number."""
        for generation in self.generations:
            generation.end(APIError(503, reason, "service_unavailable", code="service_unavailable"))
        return len(self.generations)


def _for_model(requests: list[GenerateRequest], model: str) -> list[GenerateRequest]:
    """`requests`, each for the served model `model` (the processor routes it to that model's engines)."""
    for r in requests:
        r.model = model
    return requests


def _no_stream(generation: Generation) -> AsyncIterator:
    raise AssertionError("a batched chat request never streams (its model refuses stream=true)")


def end_requests(app: FastAPI, reason: str) -> int:
    """Ends the requests `app` has in flight (the server is stopping); returns how many."""
    return app.state.api.end_all(reason)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Runs `work` unless the client disconnects first; then cancels it and returns None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            return None  # the client left; cancelling `task` aborted its engine requests
        raise


async def _disconnected(request: Request) -> None:
    # The body was read before the handler ran, so the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _ids(prefix: str, request: Request, body_request_id: str | None = None) -> tuple[str, str]:
    """(the response's id, the id of its engine requests). A client's X-Request-Id (or else the
    body's `request_id`, vLLM's field) names both; the engine's gets a random suffix, since two
    clients may send the same one."""
    given = request.state.request_id_given
    request_id: str = request.state.request_id if given or body_request_id is None else body_request_id
    response_id = f"{prefix}-{request_id}"
    if given or body_request_id is not None:
        return response_id, f"{response_id}-{secrets.token_hex(4)}"
    return response_id, response_id


def answer_errors(app: ASGIApp) -> ASGIApp:
    """Middleware answering an exception no handler took (a bug of ours) with a 500 that names
    nothing of ours, keeping the connection: Starlette's last-resort handler answers too, but then
    re-raises, and uvicorn closes the client's keep-alive connection over it. A response already
    under way cannot be answered any more: that one still goes up."""

    async def answering(scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await app(scope, receive, watched_send)
        except Exception as exc:
            if started or scope["type"] != "http":
                raise
            await api_error_of(exc).response()(scope, receive, send)

    return answering


class RequestIdMiddleware:
    """Takes the request id from `X-Request-Id` (or makes one); with `echo` (vLLM's
    --enable-request-id-headers) answers it on every response, else on none, as vLLM does."""

    def __init__(self, app: ASGIApp, echo: bool = False) -> None:
        self.app = app
        self.echo = echo

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get(REQUEST_ID_HEADER)
        request_id = given or uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"], state["request_id_given"] = request_id, given is not None

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id if self.echo else send)


def _json(body: BaseModel, status: int = 200) -> Response:
    # pydantic writes a -inf logprob as null; json.dumps (JSONResponse) would refuse it.
    return Response(body.model_dump_json(), status_code=status, media_type="application/json")


def _error_response(status: int, info: ErrorInfo) -> Response:
    return _json(ErrorResponse(error=info), status)


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    """400 (not FastAPI's 422), naming every offending field (param: the first)."""
    errors = exc.errors() or [{}]
    first = errors[0]
    if first.get("type") == "json_invalid":  # its location is a character position, not a field
        message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
        return _error_response(400, ErrorInfo(message=message, type="invalid_request_error"))
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") not in ("value_error", "assertion_error"):
        message = (f"the body must be a JSON object, sent as Content-Type: application/json "
                   f"({first.get('msg', 'invalid request')})")  # not an object, or none
        return _error_response(400, ErrorInfo(message=message, type="invalid_request_error"))
    described: dict[str, str] = {}  # field -> its messages
    for error in errors:
        path, text, in_union = _described(error)
        key = ".".join(path)
        if in_union and key in described:
            continue  # a union's members each report the field: its first answer says enough
        described[key] = f"{described[key]}; {text}" if key in described and not in_union else text
    message = "; ".join(described.values())
    param = next((key.split(".")[0] for key in described if key), None)
    return _error_response(400, ErrorInfo(message=message, type="invalid_request_error", param=param))


def _described(error: Mapping[str, Any]) -> tuple[list[str], str, bool]:
    """(the field's path, "path: message", whether pydantic was trying a union's member) of one error.
    A check of pydantic's own ends its message with its type: "seed: Input should be ... (less_than_equal)"."""
    path: list[str] = []
    in_union = False
    for part in error.get("loc", ()):
        if isinstance(part, str) and _UNION_MEMBER.match(part):
            in_union = True
            break  # pydantic names the member of a union it tried; the user knows the field only
        if part != "body":
            path.append(str(part))
    message = str(error.get("msg", "invalid request")).removeprefix("Value error, ")
    if error.get("type") not in _OUR_OWN:  # vLLM's clients match on the type, which vLLM's 400 shows
        message = f"{message} ({error.get('type')})"
    return path, f"{'.'.join(path)}: {message}" if path else message, in_union


_OUR_OWN = ("value_error", "assertion_error", None)  # the types of our validators' errors


_UNION_MEMBER = re.compile(r"^(str|int|float|bool|[A-Z]\w*|\w+\[.*\])$")


async def _error(request: Request, exc: Exception) -> Response:
    return api_error_of(exc).response()


def _version() -> str:
    try:
        return importlib.metadata.version("kvmesh")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
