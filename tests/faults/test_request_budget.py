"""Requests whose answer could grow without end, sent to `kvmesh serve` as a client would:

- /detokenize of more ids than the model's context holds is a 400 naming `tokens` and the bound,
  before the processor decodes any of them (200k ids used to become ~16 MB of text); a list
  within the bound still decodes;
- a chat whose `tools` is megabytes of numbers (which templates render with `tojson`) is a 400
  naming `messages` and the characters-per-token bound, as if it were that much text; it used to
  count as a few characters and be rendered and tokenized whole.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.services.procs import Serve, serving

pytestmark = [pytest.mark.services, pytest.mark.slow]


@pytest.fixture(scope="module")
def serve(model_path: Path) -> Iterator[Serve]:
    yield from serving(model_path)


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
