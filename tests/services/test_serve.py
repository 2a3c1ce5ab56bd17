"""`kvmesh serve` as a user runs it, driven by the official `openai` client: the same greedy text as
the in-process LLM, clients that go away free their KV blocks in the engine, SIGTERM during
traffic stops every process within 15 s, and killing `kvmesh serve` itself stops its children (a dead
service is restarted: tests/faults/test_supervision.py).

The first tests talk to the session's shared stack (`serve`, tests/conftest.py); those
that stop or kill `kvmesh serve` or one of its services start their own."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time

import openai
import pytest

from services import LLM, SamplingParams
from tests.services.procs import (SERVE_KV_BYTES, SHARED_MAX_MODEL_LEN, Serve, client_for, gone,
                                  running_serve)

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time, in a small village by the sea,"]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "user", "content": "Write a haiku about the sea."}]]
ENDLESS = {"max_tokens": 1000, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_openai_client_matches_the_offline_llm(serve: Serve, offline: LLM):
    client, model = client_for(serve)
    expected = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, logprobs=2))
    texts = [o.outputs[0].text for o in expected]
    whole = client.completions.create(model=model, prompt=PROMPTS, temperature=0, max_tokens=16)
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == texts
    assert whole.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    for prompt, text in zip(PROMPTS, texts):
        stream = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=16, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream) == text
    with_logprobs = client.completions.create(model=model, prompt=PROMPTS[0], temperature=0, max_tokens=16, logprobs=2)
    [choice] = with_logprobs.choices
    assert choice.text == texts[0]
    offline_logprobs = [next(iter(step.values())).logprob for step in expected[0].outputs[0].logprobs]
    assert choice.logprobs.token_logprobs == pytest.approx(offline_logprobs, rel=1e-3, abs=1e-3)

    chat_texts = [o.outputs[0].text for o in offline.chat(CHATS, SamplingParams(temperature=0, max_tokens=24))]
    for messages, text in zip(CHATS, chat_texts):
        reply = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24)
        assert reply.choices[0].message.content == text and reply.choices[0].message.role == "assistant"
        stream = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
        # The second time, the prompt's full blocks come from the prefix cache.
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 16
    serve.wait_until_engine_idle()


def test_errors_reach_the_client_in_openai_shape(serve: Serve):
    client, model = client_for(serve)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=model, prompt="word " * 300, max_tokens=4)  # ~300 tokens, 256 fit
    with pytest.raises(openai.BadRequestError, match="max-chars-per-token"):  # refused before tokenizing
        client.completions.create(model=model, prompt="word " * 10000, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model=model, messages=CHATS[0], top_p=7)
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        client.completions.create(model="no-such-model", prompt="x")
    serve.wait_until_engine_idle()


def test_streaming_client_that_disconnects_frees_its_blocks(serve: Serve):
    client, model = client_for(serve)
    stream = client.completions.create(model=model, prompt="Tell me a long story.", stream=True, **ENDLESS)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stats = serve.engine_stats()
    assert stats.num_running == 1 and stats.num_used_blocks > 0
    stream.close()
    serve.wait_until_engine_idle()


def test_client_that_times_out_frees_its_blocks(serve: Serve):
    client, model = client_for(serve, timeout=1.0)
    start = time.monotonic()
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model=model, prompt="Tell me a long story.", **ENDLESS)
    assert time.monotonic() - start < 5
    serve.wait_until_engine_idle()


def test_the_worker_says_how_many_tokens_its_kv_cache_holds(serve: Serve):
    # vLLM's sizing lines, which operators read to size a deployment.
    log = serve.stderr_path.read_text(errors="replace")
    size = re.search(r"worker: KV cache size: (\d+) tokens \((\d+) blocks, ([\d.]+) GiB\)", log)
    concurrency = re.search(r"worker: Maximum concurrency for (\d+) tokens per request: ([\d.]+)x", log)
    assert size and concurrency, log[-2000:]
    tokens, blocks, gib = int(size[1]), int(size[2]), float(size[3])
    assert tokens == blocks * 16 and 0 < gib <= SERVE_KV_BYTES / 2**30
    assert int(concurrency[1]) == SHARED_MAX_MODEL_LEN
    assert float(concurrency[2]) == round(tokens / SHARED_MAX_MODEL_LEN, 2)


def test_sigterm_during_traffic_stops_everything_within_15s(served_model: str):
    with running_serve(served_model) as serve:
        sigterm_during_traffic(serve)


def sigterm_during_traffic(serve: Serve) -> None:
    client, model = client_for(serve)
    results: list[object] = []
    first_token = threading.Event()

    def streamed() -> None:
        try:
            text, finish = "", None
            for chunk in client.chat.completions.create(model=model, messages=CHATS[0], max_tokens=32,
                                                        temperature=0, stream=True):
                first_token.set()
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            results.append(finish)
        except openai.APIError as e:  # ending with an error that says why is clean too; hanging is not
            results.append(e)

    def whole() -> None:
        try:
            results.append(client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=32,
                                                     temperature=0).choices[0].finish_reason)
        except openai.APIError as e:
            results.append(e)

    threads = [threading.Thread(target=f) for f in (streamed, streamed, whole, whole)]
    for t in threads:
        t.start()
    assert first_token.wait(60)
    start = time.monotonic()
    serve.proc.send_signal(signal.SIGTERM)
    try:
        code = serve.proc.wait(15)
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvmesh serve still running 15 s after SIGTERM:\n{serve.log()}")
    elapsed = time.monotonic() - start
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert code == 0, serve.log()
    assert all(gone(pid) for pid in serve.child_pids), serve.log()
    # Each request finished within the gateway's grace, or was ended with a 503 / an error event
    # saying why (on a busy machine, 32 tokens may take longer than the grace).
    assert len(results) == len(threads), results
    for result in results:
        assert result in ("length", "stop") or "shutting down" in str(result), (results, elapsed)


def test_children_stop_when_serve_itself_is_killed(served_model: str):
    """SIGKILL leaves `kvmesh serve` no chance to stop anything: each child asked the kernel for a
    SIGTERM when its parent dies (the parent-death signal it sets on itself at start)."""
    with running_serve(served_model) as serve:
        serve.proc.send_signal(signal.SIGKILL)
        serve.proc.wait(5)
        deadline = time.monotonic() + 20
        while not all(gone(pid) for pid in serve.child_pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(gone(pid) for pid in serve.child_pids), serve.log()
