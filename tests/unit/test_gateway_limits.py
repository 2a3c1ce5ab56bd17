"""Limits and errors at the gateway, in-process over the AsyncProcessor and a scripted engine: each
limit refused with a 400 naming it (and accepted at the limit), the body size checked as it streams,
every error in OpenAI's shape (never FastAPI's 422, never a 500), the overload 503 with Retry-After,
and the OpenAPI schema declaring the 400s it answers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2 as httpx
import pytest

from services.common.engine_output import EngineCoreOutput, EngineCoreRequest
from services.common.errors import EngineOverloadedError
from services.gateway.app import create_app
from services.common.config import Limits
from services.common.flags import to_argv
from services.processor.async_processor import AsyncProcessor
from services.processor.processor import Processor
from tests.unit.test_gateway import MAX_MODEL_LEN, MODEL, ScriptedEngine, assert_openai_error

pytestmark = pytest.mark.anyio

LIMITS = Limits(max_body_bytes=4096, max_prompts=3, max_n=2, max_logprobs=3, max_stop_strings=2,
                max_stop_string_length=5, max_tokens=8, max_allowed_token_ids=4, max_logit_bias=2,
                max_stop_token_ids=2, max_answer_tokens=48)
CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


class FullEngine(ScriptedEngine):
    """An engine whose waiting queue is full."""

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        raise EngineOverloadedError("the engine is full (1 running, 1 waiting)")
        yield  # an async generator, as the real one




@pytest.fixture
def engine(tokenizer) -> ScriptedEngine:
    return ScriptedEngine(tokenizer, tokenizer.eos_token_id)


def make_app(tokenizer, model_path: Path, engine: ScriptedEngine, limits: Limits = LIMITS):
    processor = Processor.for_tokenizer(tokenizer, model_path, MAX_MODEL_LEN)
    return create_app(AsyncProcessor(processor, engine), MODEL, limits=limits)


@pytest.fixture
async def client(tokenizer, model_path: Path, engine) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(tokenizer, model_path, engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c


@pytest.mark.parametrize("path, over, at, param, flag", [
    ("/v1/completions", {"prompt": ["a", "b", "c", "d"]}, {"prompt": ["a", "b", "c"]}, "prompt", "--max-prompts"),
    ("/v1/completions", {"prompt": [[1], [2], [3], [4]]}, {"prompt": [[1], [2], [3]]}, "prompt", "--max-prompts"),
    ("/v1/completions", {"prompt": "a", "n": 3}, {"prompt": "a", "n": 2}, "n", "--max-n"),
    ("/v1/completions", {"prompt": "a", "logprobs": 4}, {"prompt": "a", "logprobs": 3}, "logprobs",
     "--max-logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 4},
     {**CHAT, "logprobs": True, "top_logprobs": 3}, "top_logprobs", "--max-logprobs"),
    ("/v1/completions", {"prompt": "a", "stop": ["x", "y", "z"]}, {"prompt": "a", "stop": ["x", "y"]}, "stop",
     "--max-stop-strings"),
    ("/v1/completions", {"prompt": "a", "stop": "abcdef"}, {"prompt": "a", "stop": "abcde"}, "stop",
     "--max-stop-string-length"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 9}, {"prompt": "a", "max_tokens": 8}, "max_tokens",
     "--max-tokens-limit"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 9}, {**CHAT, "max_completion_tokens": 8},
     "max_completion_tokens", "--max-tokens-limit"),
    # Token-id lists count as sent, duplicates too.
    ("/v1/completions", {"prompt": "a", "allowed_token_ids": [5, 5, 5, 5, 5]},
     {"prompt": "a", "allowed_token_ids": [5, 5, 6, 7]}, "allowed_token_ids", "--max-allowed-token-ids"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 1, "6": 1, "7": 1}}, {**CHAT, "logit_bias": {"5": 1, "6": 1}},
     "logit_bias", "--max-logit-bias"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [9, 9, 9]}, {"prompt": "a", "stop_token_ids": [9, 9]},
     "stop_token_ids", "--max-stop-token-ids"),
    # The answer: choices x max_tokens x (1 + top logprobs), here 2 x 7 x 4 = 56 over 48, 2 x 6 x 4 at it.
    ("/v1/completions", {"prompt": "a", "n": 2, "logprobs": 3, "max_tokens": 7},
     {"prompt": "a", "n": 2, "logprobs": 3, "max_tokens": 6}, "max_tokens", "--max-answer-tokens"),
    ("/v1/chat/completions", {**CHAT, "n": 2, "logprobs": True, "top_logprobs": 3, "max_tokens": 7},
     {**CHAT, "n": 2, "logprobs": True, "top_logprobs": 3, "max_tokens": 6}, "max_tokens", "--max-answer-tokens"),
])
async def test_over_a_limit_is_a_400_naming_it(client, engine, path, over, at, param, flag):
    error = assert_openai_error(await client.post(path, json=over), 400)
    assert error["param"] == param and error["code"] == "limit_exceeded" and flag in error["message"], error
    assert not engine.requests
    assert (await client.post(path, json=at)).status_code == 200


async def test_an_open_max_tokens_is_capped_at_the_limit(client, engine):
    r = await client.post("/v1/chat/completions", json=CHAT)  # chat's default: the rest of the context
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert engine.requests[0].sampling_params.max_tokens == 8


async def test_an_open_max_tokens_is_what_the_answer_limit_leaves(client, engine):
    """Two choices with three top logprobs each: 8 answer tokens a step, so 48 leave 6 steps."""
    body = {**CHAT, "n": 2, "logprobs": True, "top_logprobs": 3}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2 * 6
    assert {c["finish_reason"] for c in r.json()["choices"]} == {"length"}
    assert all(request.sampling_params.max_tokens == 6 for request in engine.requests)


async def test_choices_that_cannot_produce_a_token_within_the_answer_limit_are_a_400(tokenizer, model_path: Path,
                                                                                     engine):
    app = make_app(tokenizer, model_path, engine, Limits(max_answer_tokens=4))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        body = {"prompt": "a", "n": 2, "logprobs": 3}  # 2 x (1 + 3) = 8 answer tokens for one step
        error = assert_openai_error(await client.post("/v1/completions", json=body), 400)
        assert error["param"] == "n" and "--max-answer-tokens" in error["message"], error
        assert (await client.post("/v1/completions", json={**body, "n": 1})).status_code == 200
    assert len(engine.requests) == 1


async def test_the_body_size_is_checked_as_it_streams(client, engine):
    under = {"prompt": "a", "max_tokens": 1, "user": "u" * 3000}
    assert (await client.post("/v1/completions", json=under)).status_code == 200
    big = json.dumps({"prompt": "a" * 5000}).encode()
    error = assert_openai_error(await client.post("/v1/completions", content=big,
                                                  headers={"content-type": "application/json"}), 400)
    assert "--max-body-bytes" in error["message"] and error["code"] == "limit_exceeded"

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked, refused once past the limit
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]
    error = assert_openai_error(await client.post("/v1/completions", content=chunks(),
                                                  headers={"content-type": "application/json"}), 400)
    assert "more than 4096 bytes" in error["message"]
    r = await client.post("/v1/completions", content=b"{}", headers={"content-type": "application/json",
                                                                        "content-length": "x"})
    assert_openai_error(r, 400)
    assert len(engine.requests) == 1


@pytest.mark.parametrize("body, message", [
    (b"{not json", "not valid JSON"),
    (b"[]", "JSON object"), (b"1", "JSON object"), (b'"x"', "JSON object"), (b"null", "JSON object"),
    (b"", "JSON object"),
    (b'{"prompt": "x", "n": "two"}', "n:"), (b'{"prompt": "x", "stream": "maybe"}', "stream:"),
    (b'{"prompt": "x", "max_tokens": 1.5}', "max_tokens:"), (b'{"prompt": 5}', "prompt"),
    (b'{"prompt": [1, "a"]}', "prompt"), (b'{"prompt": [[]]}', "empty"), (b'{"prompt": [""]}', "empty"),
    (b'{"prompt": "x", "stream_options": {"include_usage": true}}', "stream"),
    (b'{"prompt": [5, 99999999]}', "99999999"), (b'{"prompt": [-1]}', "-1"),
])
async def test_bad_bodies_are_400_in_openai_shape(client, engine, body, message):
    r = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert message in assert_openai_error(r, 400)["message"]
    assert not engine.requests


async def test_a_prompt_longer_than_the_context_names_both_lengths(client):
    error = assert_openai_error(await client.post("/v1/completions", json={"prompt": [1] * MAX_MODEL_LEN}), 400)
    assert str(MAX_MODEL_LEN) in error["message"] and f"{MAX_MODEL_LEN} tokens" in error["message"]


async def test_wrong_content_type_unknown_path_and_method(client):
    r = await client.post("/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
    assert "Content-Type: application/json" in assert_openai_error(r, 400)["message"]
    assert_openai_error(await client.get("/v1/nothing"), 404)
    r = await client.put("/v1/completions", json={})
    assert_openai_error(r, 405)
    assert r.headers["allow"] == "POST"


async def test_a_full_engine_is_a_503_with_retry_after(tokenizer, model_path: Path):
    app = make_app(tokenizer, model_path, FullEngine(tokenizer, tokenizer.eos_token_id))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        for stream in (False, True):
            r = await client.post("/v1/completions", json={"prompt": "x", "stream": stream})
            error = assert_openai_error(r, 503)
            assert r.headers["retry-after"] == "1" and error["code"] == "overloaded" and "full" in error["message"]


def test_limits_refuse_nonsense():
    with pytest.raises(ValueError, match="max_n"):
        Limits(max_n=0)
    with pytest.raises(ValueError, match="max_logprobs"):
        Limits(max_logprobs=-2)  # -1 is "no limit", above 20 is allowed (vLLM)
    assert to_argv(Limits(max_n=3, max_tokens=5))[-4:] == ["--max-answer-tokens", "131072",
                                                          "--max-tokens-limit", "5"]


def test_openapi_declares_400s_and_no_422(tokenizer, model_path: Path, engine):
    schema = make_app(tokenizer, model_path, engine).openapi()
    text = json.dumps(schema)
    assert '"422"' not in text and "HTTPValidationError" not in text
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        ref = responses["400"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == "#/components/schemas/ErrorResponse", responses
