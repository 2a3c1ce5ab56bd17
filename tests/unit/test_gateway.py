"""The gateway app over the AsyncProcessor, in-process: HTTP status codes, OpenAI's error shape,
SSE framing, request ids, and aborts reaching the engine when a client goes away or a stop string
hits. The engine is scripted (it streams a fixed text token by token), so these tests need the
tokenizer only; test_gateway_stack.py runs the same app over the real in-process engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import httpx2 as httpx
import pytest

from services.common.clients import EngineInfo, EngineStats
from services.common.engine_output import EngineCoreOutput, EngineCoreRequest
from services.common.errors import EngineDeadError, EngineOverloadedError, InternalError
from services.common.model_runner_output import TokenLogprobs
from services.gateway.app import ApiOptions, create_app, end_requests
from services.gateway.errors import RETRY_AFTER, UNAVAILABLE_RETRY_AFTER, api_error_of
from services.processor.async_processor import AsyncProcessor
from services.processor.processor import Processor

pytestmark = pytest.mark.anyio

MODEL = "smollm2"
SCRIPT = " The quick brown fox jumps over the lazy dog. It was a sunny day in the park."
MAX_MODEL_LEN = 256


class ScriptedEngine:
    """An EngineClient that answers every request with SCRIPT's tokens, one per step, then EOS."""

    def __init__(self, tokenizer, eos_token_id: int, step_delay: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.script = tokenizer.encode(SCRIPT, add_special_tokens=False)
        self.eos_token_id = eos_token_id
        self.step_delay = step_delay
        self.healthy = True
        self.fail_after: int | None = None  # raise fail_with after this many outputs
        self.fail_with: Exception = ConnectionError("the engine lost its worker")
        self.requests: list[EngineCoreRequest] = []
        self.aborted: list[str] = []
        self.running: set[str] = set()

    def text(self, num_tokens: int) -> str:
        """What the first `num_tokens` of the script read as."""
        return self.tokenizer.decode(self.script[:num_tokens])

    async def info(self) -> EngineInfo:
        return EngineInfo("scripted", "/models/scripted", MAX_MODEL_LEN, 16)

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        self.requests.append(request)
        self.running.add(request.request_id)
        params = request.sampling_params
        tokens = [*self.script, self.eos_token_id]
        finished = False
        try:
            for i, token in enumerate(tokens):
                await asyncio.sleep(self.step_delay)
                if self.fail_after is not None and i >= self.fail_after:
                    raise self.fail_with
                reason = None
                if token == self.eos_token_id:
                    reason = "stop"
                elif params.max_tokens is not None and i + 1 >= params.max_tokens:
                    reason = "length"
                logprobs = []
                if params.logprobs is not None:
                    logprobs = [TokenLogprobs([token, *range(params.logprobs)], [-0.5] + [-1.0] * params.logprobs, 1)]
                finished = reason is not None
                yield EngineCoreOutput(request.request_id, [token], logprobs, finish_reason=reason,
                                       num_cached_tokens=3 if i == 0 else 0)
                if finished:
                    return
        finally:
            self.running.discard(request.request_id)
            if not finished and request.request_id not in self.aborted:
                self.aborted.append(request.request_id)

    async def abort(self, request_ids: Sequence[str]) -> None:
        self.aborted.extend(r for r in request_ids if r in self.running and r not in self.aborted)

    async def stats(self) -> EngineStats:
        return EngineStats(len(self.running), 0, 0, 100, 0, 0, 0)

    async def is_healthy(self) -> bool:
        return self.healthy




@pytest.fixture
def engine(tokenizer) -> ScriptedEngine:
    return ScriptedEngine(tokenizer, tokenizer.eos_token_id)


@pytest.fixture
def app(tokenizer, model_path: Path, engine: ScriptedEngine):
    processor = Processor.for_tokenizer(tokenizer, model_path, MAX_MODEL_LEN)
    return create_app(AsyncProcessor(processor, engine), MODEL)


@pytest.fixture
async def client(app) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c


def sse_events(body: str) -> list[str]:
    """The data fields of an SSE body; asserts the framing (data lines, blank-line separated)."""
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# ----------------------------------------------------------------------------- responses


async def test_completion(client, engine):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL
    [choice] = body["choices"]
    assert choice["text"] == engine.text(5) and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["prompt_tokens"] == len(engine.requests[0].prompt_token_ids)
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    assert engine.requests[0].sampling_params.max_tokens == 5 and not engine.aborted


async def test_chat_to_the_end_drops_eos_and_counts_it(client, engine):
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": SCRIPT}
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None
    assert body["usage"]["completion_tokens"] == len(engine.script) + 1  # the EOS counts, but is not text
    assert engine.requests[0].sampling_params.max_tokens is None  # chat: the rest of the context


async def test_multiple_prompts_and_n_number_choices_in_order(client, engine):
    r = await client.post("/v1/completions", json={"prompt": ["a", "b c"], "n": 2, "max_tokens": 3, "seed": 7})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == engine.text(3) for c in body["choices"])
    assert sorted(r.sampling_params.seed for r in engine.requests) == [7, 7, 8, 8]
    prompt_lengths = {r.request_id[:-2]: len(r.prompt_token_ids) for r in engine.requests}
    assert body["usage"]["prompt_tokens"] == sum(prompt_lengths.values()) > 0
    assert body["usage"]["completion_tokens"] == 4 * 3


async def test_stop_string_cuts_the_text_and_aborts_the_engine_request(client, engine):
    r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 50, "stop": ["fox"]})
    [choice] = r.json()["choices"]
    assert choice["text"] == " The quick brown " and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == "fox"
    await asyncio.sleep(0.05)
    assert engine.aborted == [engine.requests[0].request_id] and not engine.running


async def test_logprobs_carry_token_texts(client, engine, tokenizer):
    r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "logprobs": 2})
    logprobs = r.json()["choices"][0]["logprobs"]
    first = tokenizer.decode([engine.script[0]])
    assert logprobs["tokens"] == [first, tokenizer.decode([engine.script[1]])]
    assert logprobs["token_logprobs"] == [-0.5, -0.5] and logprobs["text_offset"] == [0, len(first)]
    assert logprobs["top_logprobs"][0] == {first: -0.5, tokenizer.decode([0]): -1.0, tokenizer.decode([1]): -1.0}
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "max_tokens": 1, "logprobs": True, "top_logprobs": 1})
    [entry] = r.json()["choices"][0]["logprobs"]["content"]
    assert entry["token"] == first and entry["bytes"] == list(first.encode()) and entry["logprob"] == -0.5
    assert [t["token"] for t in entry["top_logprobs"]] == [tokenizer.decode([0])]


# ----------------------------------------------------------------------------- streaming


async def test_chat_stream_framing(client, engine):
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "stream": True, "n": 2, "max_tokens": 4,
        "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    # The first chunk of each choice carries the role and empty content.
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert sorted(c["choices"][0]["index"] for c in chunks[:2]) == [0, 1]
    *content, usage = chunks[2:]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    for index in (0, 1):
        mine = [c["choices"][0] for c in content if c["choices"][0]["index"] == index]
        assert "".join(c["delta"].get("content", "") for c in mine) == engine.text(4)
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]
        assert mine[-1]["finish_reason"] == "length"
        assert all("role" not in c["delta"] for c in mine)


async def test_completion_stream_without_usage(client, engine):
    r = await client.post("/v1/completions", json={"prompt": "Hello", "stream": True, "max_tokens": 3})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == engine.text(3)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"


async def test_engine_failure_mid_stream_is_an_error_event_then_done(client, engine):
    engine.fail_after = 3
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    # A transport error's details stay in the gateway's log: they may name internal addresses.
    assert error["message"] == "the model is not available" and error["type"] == "service_unavailable"
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert_openai_error(r, 503)
    assert r.headers["retry-after"] == str(UNAVAILABLE_RETRY_AFTER)  # a restarted service is back in seconds


@pytest.mark.parametrize("error, status, retry_after", [
    (EngineDeadError("engine step failed"), 503, UNAVAILABLE_RETRY_AFTER), (EngineOverloadedError("full"), 503, RETRY_AFTER),
    (TimeoutError("deadline"), 504, None), (InternalError("internal error"), 500, None),
])
async def test_each_engine_error_has_its_status(client, engine, error, status, retry_after):
    engine.fail_after, engine.fail_with = 0, error
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert_openai_error(r, status)
    assert r.headers.get("retry-after") == (None if retry_after is None else str(retry_after))


def test_a_bug_of_ours_is_a_500_that_says_nothing_of_it():
    error = api_error_of(KeyError("secret-of-another-client"))
    assert error.status == 500 and "secret" not in error.info.message and "KeyError" not in error.info.message


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL}, "prompt"),  # missing
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, None),  # without stream
    ({"prompt": "x", "max_tokens": 0}, None),  # SamplingParams refuses
    ({"prompt": "x", "top_p": 1.5}, None),
    ({"prompt": "x", "logit_bias": {"fox": 1}}, None),
    ({"prompt": "x", "logit_bias": {"999999": 1}}, None),  # out of vocabulary
    ({"prompt": "x", "stop": [""]}, None),
    ({"prompt": ""}, None),  # empty prompt
    ({"prompt": []}, None),
    ({"prompt": [10**9]}, None),  # token id out of vocabulary
    ({"prompt": "word " * MAX_MODEL_LEN}, None),  # longer than the context
])
async def test_invalid_completion_is_400_in_openai_shape(client, engine, body, param):
    error = assert_openai_error(await client.post("/v1/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    assert not engine.running


async def test_invalid_chat_and_malformed_json_are_400(client):
    assert_openai_error(await client.post("/v1/chat/completions", json={"messages": []}), 400)
    assert_openai_error(await client.post("/v1/chat/completions", json={"messages": [{"content": "no role"}]}), 400)
    assert_openai_error(await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}), 400)
    assert_openai_error(await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}), 400)
    r = await client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


async def test_unknown_model_is_404(client):
    error = assert_openai_error(await client.post("/v1/completions", json={"model": "gpt-5", "prompt": "x"}), 404)
    assert error["param"] == "model" and "gpt-5" in error["message"]
    r = await client.post("/v1/chat/completions",
                          json={"model": "gpt-5", "messages": [{"role": "user", "content": "x"}]})
    assert_openai_error(r, 404)


async def test_request_id_is_honoured_and_echoed_only_when_asked(client, engine, tokenizer, model_path):
    """X-Request-Id names the request always; it comes back on responses only with
    --enable-request-id-headers (vLLM's flag, off by default as in vLLM)."""
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"X-Request-Id": "abc-123"})
    assert "x-request-id" not in r.headers and r.json()["id"] == "cmpl-abc-123"
    assert engine.requests[0].request_id.startswith("cmpl-abc-123-")  # two clients may reuse an id
    processor = Processor.for_tokenizer(tokenizer, model_path, MAX_MODEL_LEN)
    app = create_app(AsyncProcessor(processor, engine), MODEL, options=ApiOptions(request_id_headers=True))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as echoing:
        r = await echoing.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                               headers={"X-Request-Id": "abc-123"})
        assert r.headers["x-request-id"] == "abc-123" and r.json()["id"] == "cmpl-abc-123"
        r = await echoing.post("/v1/completions", json={"model": "nope", "prompt": "x"}, headers={"X-Request-Id": "e1"})
        assert r.status_code == 404 and r.headers["x-request-id"] == "e1"
        r = await echoing.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.json()["id"] == f"cmpl-{r.headers['x-request-id']}"


async def test_session_header_becomes_the_session_id(client, engine, tokenizer, model_path):
    """The x-session-id header reaches the engine requests (what `--routing session` routes by), for
    completions and chat alike; longer than 256 characters is a 400; a gateway may name another header."""
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"X-Session-Id": "s-1"})
    assert r.status_code == 200, r.text
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                        "max_tokens": 1}, headers={"x-session-id": "s" * 256})
    assert r.status_code == 200, r.text
    await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert [q.session_id for q in engine.requests] == ["s-1", "s" * 256, None]
    error = assert_openai_error(await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                                                  headers={"x-session-id": "s" * 257}), 400)
    assert error["param"] == "x-session-id" and "256" in error["message"]
    assert len(engine.requests) == 3
    processor = Processor.for_tokenizer(tokenizer, model_path, MAX_MODEL_LEN)
    app = create_app(AsyncProcessor(processor, engine), MODEL, session_header="x-user")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as other:
        await other.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                         headers={"x-user": "u-9", "x-session-id": "ignored"})
    assert engine.requests[-1].session_id == "u-9"


async def test_return_tokens_as_token_ids_flag_is_the_request_fields_default(tokenizer, model_path, engine):
    """The gateway's --return-tokens-as-token-ids (vLLM's flag): logprob tokens as "token_id:N" unless a
    request's return_tokens_as_token_ids says otherwise."""
    processor = Processor.for_tokenizer(tokenizer, model_path, MAX_MODEL_LEN)
    app = create_app(AsyncProcessor(processor, engine), MODEL, options=ApiOptions(return_tokens_as_token_ids=True))
    body = {"prompt": "x", "max_tokens": 2, "logprobs": 1}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        by_id = (await client.post("/v1/completions", json=body)).json()["choices"][0]["logprobs"]
        as_text = (await client.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False})
                   ).json()["choices"][0]["logprobs"]
    assert by_id["tokens"] == [f"token_id:{t}" for t in engine.script[:2]]
    assert as_text["tokens"] == [tokenizer.decode([t]) for t in engine.script[:2]]


async def test_health_models_version(client, engine):
    assert (await client.get("/health")).status_code == 200
    engine.healthy = False
    assert_openai_error(await client.get("/health"), 503)
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert (await client.get("/version")).json()["version"]


# ----------------------------------------------------------------------------- clients that go away


class RawClient:
    """Calls the ASGI app directly so the test decides when the client disconnects."""

    def __init__(self, app, path: str, body: dict) -> None:
        self.app, self.path, self.body = app, path, json.dumps(body).encode()
        self.disconnect = asyncio.Event()
        self.messages: list[dict] = []
        self.got_body = asyncio.Event()

    async def __call__(self) -> None:
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        sent_body = False

        async def receive() -> dict:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": self.body, "more_body": False}
            await self.disconnect.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            self.messages.append(message)
            if message["type"] == "http.response.body" and message.get("body"):
                self.got_body.set()

        await self.app(scope, receive, send)


@pytest.mark.parametrize("stream", [False, True])
async def test_client_that_goes_away_aborts_the_engine_request(app, engine, stream):
    engine.step_delay = 0.05  # SCRIPT takes about a second to stream
    client = RawClient(app, "/v1/completions", {"prompt": "Hello", "max_tokens": 100, "stream": stream})
    call = asyncio.create_task(client())
    if stream:
        await asyncio.wait_for(client.got_body.wait(), 5)
    else:
        while not engine.requests:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
    client.disconnect.set()
    await asyncio.wait_for(call, 2)  # the handler ends at once, long before the script would
    for _ in range(50):
        if engine.aborted:
            break
        await asyncio.sleep(0.01)
    assert engine.aborted == [engine.requests[0].request_id] and not engine.running


async def test_requests_ended_at_shutdown_get_a_503_or_an_error_event(app, client, engine):
    engine.step_delay = 0.05

    async def request(stream: bool) -> httpx.Response:
        return await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 100, "stream": stream})

    calls = [asyncio.create_task(request(stream)) for stream in (False, True)]
    while len(engine.running) < 2:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    assert end_requests(app, "the server is shutting down") == 2
    whole, streamed = await asyncio.wait_for(asyncio.gather(*calls), 5)
    assert "shutting down" in assert_openai_error(whole, 503)["message"]
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"]
    assert sorted(engine.aborted) == sorted(r.request_id for r in engine.requests) and not engine.running
