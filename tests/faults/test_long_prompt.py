"""A long prompt is slow on a CPU, never an error: under `kvmesh serve` with a worker liveness
timeout of 2 s (the old engine failed any step slower than its fixed deadline; a 3,000-token
prefill takes several seconds on two cores), the long request completes, and a chat streaming
beside it keeps getting tokens while the prompt is read: its prefill is cut into chunks that each
take about --target-step-seconds (AdaptiveChunking), not two steps of seconds each."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx2 as httpx
import pytest

from tests.services.procs import Serve, start_serve

pytestmark = pytest.mark.slow

LONG_PROMPT = "The quick brown fox jumps over the lazy dog near the river bank. " * 230  # ~3,000 tokens
FLAGS = ["--max-model-len", "8192", "--kv-cache-memory", "256MiB", "--worker-liveness-interval", "0.2",
         "--worker-liveness-timeout", "2", "--target-step-seconds", "0.25"]


@pytest.fixture(scope="module")
def serve(served_model: str) -> Iterator[Serve]:
    serve = start_serve(served_model, extra_args=FLAGS)
    try:
        yield serve
    finally:
        serve.kill()


def stream(client: httpx.Client, path: str, body: dict, times: list[float], stop: threading.Event) -> list[str]:
    """Stream `body`; append each content event's arrival time to `times`; close early once `stop`."""
    events = []
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
                events.append(line)
            if stop.is_set() or line == "data: [DONE]":
                break
    return events


def test_long_prompt_completes_while_a_chat_keeps_streaming(serve: Serve):
    chat_times: list[float] = []
    long_times: list[float] = []
    done = threading.Event()
    chat_body = {"messages": [{"role": "user", "content": "Count to a thousand."}],
                 "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    long_body = {"prompt": LONG_PROMPT, "max_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=serve.api.removesuffix("/v1"), timeout=600) as client:
        chat = threading.Thread(target=stream, args=(client, "/v1/chat/completions", chat_body, chat_times, done))
        chat.start()
        deadline = time.monotonic() + 60
        while len(chat_times) < 5:
            assert time.monotonic() < deadline and chat.is_alive(), "the chat never started"
            time.sleep(0.05)
        sent = time.monotonic()
        try:
            long_events = stream(client, "/v1/completions", long_body, long_times, threading.Event())
        finally:
            done.set()
            chat.join(60)
    first = long_times[0]
    final = json.loads(long_events[-1].removeprefix("data: "))
    assert final["choices"][0]["finish_reason"] == "length", long_events[-1]

    # While the long prompt was read (sent -> its first token), the chat kept streaming: many
    # tokens, and no gap anywhere near the whole prefill.
    during = [t for t in chat_times if sent <= t <= first]
    prefill = first - sent
    gaps = [b - a for a, b in zip([sent, *during], [*during, first])]
    assert len(during) >= 5, (len(during), prefill)
    assert max(gaps) < prefill / 3, (max(gaps), prefill)
