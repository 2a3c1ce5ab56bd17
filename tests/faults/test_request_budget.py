"""Requests whose answer could grow without end, sent to `kvmesh serve` as a client would:

- /detokenize of more ids than the model's context holds is a 400 naming `tokens` and the bound,
  before the processor decodes any of them (200k ids used to become ~16 MB of text); a list
  within the bound still decodes;
- a chat whose `tools` is megabytes of numbers (which templates render with `tojson`) is a 400
  naming `messages` and the characters-per-token bound, as if it were that much text; it used to
  count as a few characters and be rendered and tokenized whole;
- an answer over --max-answer-tokens (choices x max_tokens x (1 + top logprobs); ~13.5 KB a token
  for a non-streamed chat with 20 top logprobs) is a 400 that says how much fits;
- a streaming client that stops reading is cut off --send-timeout after its socket filled, its
  request aborted in the engine (its KV blocks freed), instead of the gateway buffering the stream.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator

import pytest

from tests.services.procs import Serve, gateway_over

pytestmark = pytest.mark.slow

SEND_TIMEOUT = 3.0


@pytest.fixture(scope="module")
def serve(serve: Serve) -> Iterator[Serve]:
    with gateway_over(serve, ["--send-timeout", str(SEND_TIMEOUT)]) as gateway:
        yield gateway


def _post(serve: Serve, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_detokenize_is_bounded_by_the_context(serve: Serve) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=30)
    conn.request("GET", "/v1/models")
    models = json.loads(conn.getresponse().read())
    conn.close()
    max_model_len = models["data"][0]["max_model_len"]

    status, body = _post(serve, "/detokenize", {"tokens": [42] * (max_model_len + 1)})
    assert status == 400, body
    error = body["error"]
    assert error["param"] == "tokens" and error["type"] == "invalid_request_error"
    assert str(max_model_len) in error["message"]

    status, body = _post(serve, "/detokenize", {"tokens": [42] * 8})
    assert status == 200 and isinstance(body["prompt"], str) and body["prompt"]


def test_tools_of_numbers_count_towards_the_prompt_bound(serve: Serve) -> None:
    numbers = [1] * 1_500_000  # ~3 MB of JSON, under the body limit, once 66 characters of strings
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "enum": numbers}}}]
    status, body = _post(serve, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "tools": tools, "tool_choice": "none", "max_tokens": 1})
    assert status == 400, body
    error = body["error"]
    assert error["param"] == "messages" and "--max-chars-per-token" in error["message"], error


def test_an_answer_over_the_budget_is_a_400_that_says_what_fits(serve: Serve) -> None:
    # The default budget, 131072: 16 choices x 391 tokens x (1 + 20) is over it, 390 fit.
    body = {"prompt": "Hello", "n": 16, "logprobs": 20, "max_tokens": 391}
    status, answer = _post(serve, "/v1/completions", body)
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == "max_tokens" and error["code"] == "limit_exceeded", error
    assert "--max-answer-tokens" in error["message"] and "at most 390 fit" in error["message"], error
    status, answer = _post(serve, "/v1/completions", {**body, "max_tokens": 1})
    assert status == 200 and len(answer["choices"]) == 16, answer


def test_a_client_that_stops_reading_is_cut_off_and_its_request_aborted(serve: Serve) -> None:
    """The client takes a few KB and then nothing: the stream fills its socket and the gateway's
    write buffer (~0.6 MB: a few hundred tokens), the gateway pauses it, and aborts it SEND_TIMEOUT
    later, long before its 8 x 200 tokens (~1 KB each, with 20 top logprobs; a minute of work on
    the shared stack's one sequence at a time) could be generated."""
    body = json.dumps({"messages": [{"role": "user", "content": "Count to a thousand."}], "stream": True, "n": 8,
                       "max_tokens": 200, "ignore_eos": True, "logprobs": True, "top_logprobs": 20}).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, as a stalled phone's
    sock.connect(("127.0.0.1", serve.port))
    start = time.monotonic()
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = start + 120
        while serve.engine_stats().num_running == 0:  # admitted
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.2)
        while (stats := serve.engine_stats()).num_running or stats.num_used_blocks:  # aborted, blocks freed
            assert time.monotonic() < deadline, f"the stalled stream was never aborted: {stats}\n{serve.log()}"
            time.sleep(0.5)
        elapsed = time.monotonic() - start
        sock.settimeout(10)
        # The gateway reset the connection: what it and the kernel held for it was dropped, so the
        # client learns of the reset at once, however much it never read.
        with pytest.raises(ConnectionResetError):
            while sock.recv(65536):
                pass
    finally:
        sock.close()
    assert elapsed >= SEND_TIMEOUT
    conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=10)  # the gateway serves on
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
    finally:
        conn.close()
