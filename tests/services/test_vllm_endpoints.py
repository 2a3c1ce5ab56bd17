"""vLLM's routes beyond OpenAI's: /ping and /invocations (SageMaker's pair), /load (what
routers poll) and /v1/chat/completions/batch, through `kvmesh serve` with raw HTTP (the `openai`
client has no method for them) and compared with what the `openai` client gets from the routes
they stand for.

On the session's shared stack (`serve`, tests/conftest.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx2 as httpx
import openai
import pytest

from tests.services.procs import Serve, client_for

CONVERSATIONS = [[{"role": "user", "content": "Name three colours."}],
                 [{"role": "user", "content": "What is two plus two?"}]]
GREEDY = {"temperature": 0, "max_tokens": 5}


@pytest.fixture(scope="module")
def openai_client(serve: Serve) -> tuple[openai.OpenAI, str]:
    return client_for(serve)


@pytest.fixture(scope="module")
def client(openai_client) -> openai.OpenAI:
    return openai_client[0]


@pytest.fixture(scope="module")
def model(openai_client) -> str:
    return openai_client[1]


@pytest.fixture(scope="module")
def http(serve: Serve) -> Iterator[httpx.Client]:
    """Raw HTTP on the API's root: none of these routes has a method in the `openai` client."""
    with httpx.Client(base_url=serve.api.removesuffix("/v1"), timeout=120) as raw:
        yield raw


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_ping_answers_as_health(http):
    for method in ("GET", "POST"):
        response = http.request(method, "/ping")
        assert response.status_code == 200 and response.content == b""


def test_invocations_routes_by_the_body(client, model, http):
    chat = client.chat.completions.create(model=model, messages=CONVERSATIONS[0], **GREEDY)
    response = http.post("/invocations", json={"model": model, "messages": CONVERSATIONS[0], **GREEDY})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"]["content"] == chat.choices[0].message.content
    completion = client.completions.create(model=model, prompt="The capital of France is", **GREEDY)
    body = http.post("/invocations", json={"prompt": "The capital of France is", **GREEDY}).json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == completion.choices[0].text
    # Streamed, as its own route streams.
    with http.stream("POST", "/invocations", json={"prompt": "Hi", "stream": True, **GREEDY}) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[0])["object"] == "text_completion"


def test_invocations_refuses_what_no_route_takes(http):
    error = error_of(http.post("/invocations", json={"input": "embed me"}), 400)
    assert "Cannot find suitable handler" in error["message"] and "ChatCompletionRequest" in error["message"]
    error = error_of(http.post("/invocations", json=["not", "an", "object"]), 400)
    assert "CompletionRequest" in error["message"]
    error = error_of(http.post("/invocations", content=b"{not json", headers={"content-type": "application/json"}),
                     400)
    assert "not valid JSON" in error["message"]
    # A body of a route, with a bad field: that route's own message, naming the field.
    error = error_of(http.post("/invocations", json={"messages": CONVERSATIONS[0], "n": "many"}), 400)
    assert error["param"] == "n"


def test_load_counts_the_requests_in_flight(client, model, http):
    assert http.get("/load").json() == {"server_load": 0}
    stream = client.completions.create(model=model, prompt="Count: 1, 2, 3,", max_tokens=40, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # the request is running
    assert http.get("/load").json() == {"server_load": 1}
    stream.close()  # the client goes away: the request ends
    deadline = time.monotonic() + 30
    while http.get("/load").json()["server_load"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert http.get("/load").json() == {"server_load": 0}


def test_batched_chat_answers_each_conversation(client, model, http, serve: Serve):
    singles = [client.chat.completions.create(model=model, messages=c, **GREEDY) for c in CONVERSATIONS]
    response = http.post("/v1/chat/completions/batch", json={"model": model, "messages": CONVERSATIONS,
                                                              "logprobs": True, **GREEDY})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == model
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice, single in zip(body["choices"], singles):
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["content"] == single.choices[0].message.content
        assert choice["finish_reason"] == single.choices[0].finish_reason
        assert [t["token"] for t in choice["logprobs"]["content"]] and len(choice["logprobs"]["content"]) == \
            single.usage.completion_tokens
    usage = body["usage"]
    assert usage["prompt_tokens"] == sum(s.usage.prompt_tokens for s in singles)
    assert usage["completion_tokens"] == sum(s.usage.completion_tokens for s in singles)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    serve.wait_until_engine_idle()


def test_batched_chat_logprobs_and_ids_as_its_single_chats(client, model, http):
    # logprob_token_ids, tokens written as ids and return_token_ids mean in a batch what they mean in
    # /v1/chat/completions: each choice is its conversation's single chat's.
    asked = http.post("/tokenize", json={"prompt": " red green"}).json()["tokens"]
    extra = {"logprob_token_ids": asked, "return_tokens_as_token_ids": True, "return_token_ids": True}
    singles = [client.chat.completions.create(model=model, messages=c, logprobs=True, **GREEDY, extra_body=extra)
               for c in CONVERSATIONS]
    response = http.post("/v1/chat/completions/batch", json={"model": model, "messages": CONVERSATIONS,
                                                              "logprobs": True, **GREEDY, **extra})
    assert response.status_code == 200, response.text
    for choice, single in zip(response.json()["choices"], singles):
        ids = single.choices[0].model_dump()["token_ids"]
        assert choice["token_ids"] == ids and len(ids) == single.usage.completion_tokens
        content = choice["logprobs"]["content"]
        assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids]
        for entry, other in zip(content, single.choices[0].logprobs.content):
            assert [t["token"] for t in entry["top_logprobs"]] == [t.token for t in other.top_logprobs]
            assert {t["token"] for t in entry["top_logprobs"]} == {entry["token"], *(f"token_id:{t}" for t in asked)}
    # Without them, text, as the singles.
    plain = http.post("/v1/chat/completions/batch", json={"model": model, "messages": CONVERSATIONS[:1],
                                                           "logprobs": True, "top_logprobs": 1, **GREEDY}).json()
    assert not plain["choices"][0]["logprobs"]["content"][0]["token"].startswith("token_id:")
    assert plain["choices"][0]["token_ids"] is None


def test_batched_chat_refuses_what_vllm_refuses(http):
    for extra, param in (({"stream": True}, "stream"), ({"n": 2}, "n"), ({"messages": []}, "messages"),
                         ({"messages": [[]]}, "messages"), ({"messages": CONVERSATIONS[0]}, "messages")):
        error = error_of(http.post("/v1/chat/completions/batch", json={"messages": CONVERSATIONS, **extra}), 400)
        assert param in error["message"], (extra, error)
