"""Input that used to stall, grow or break the service, sent to `kvmesh serve` as a client would:

- a prompt (or /tokenize text, or a chat of many tiny messages) too long for the context is refused
  with a 400 naming the limit, before anything tokenizes it, while another client's stream keeps
  flowing; the processor refuses it too when called directly, and its memory does not grow;
- a request for more sequences than --max-sequences-per-request is a 400;
- made-up HTTP methods and paths do not grow /metrics;
- bad input (deep nesting, huge integers, NaN, echo with logprobs of a one-token prompt) is a 4xx
  that names nothing of the server's insides, and the client's keep-alive connection stays usable.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import string
import threading
import time
from pathlib import Path

import openai
import pytest

from services.common.clients import GenerateRequest
from services.common.sampling_params import SamplingParams
from services.processor.client import GrpcProcessorClient
from tests.services.procs import Serve

pytestmark = pytest.mark.slow

STALL_BOUND = 6.0  # seconds: the longest pause a running stream may see while the huge inputs are refused


def _post(conn: http.client.HTTPConnection, path: str, body: str | dict) -> tuple[int, dict]:
    conn.request("POST", path, body=body if isinstance(body, str) else json.dumps(body),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read() or b"{}")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _http_series(serve: Serve) -> set[str]:
    conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=30)
    conn.request("GET", "/metrics")
    page = conn.getresponse().read().decode()
    return {line.rsplit(" ", 1)[0] for line in page.splitlines() if line.startswith("kvmesh_http_")}


def test_prompts_too_long_for_the_context_are_refused_while_a_stream_flows(serve: Serve):
    client = openai.OpenAI(base_url=serve.api, api_key="unused", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    arrivals: list[float] = []
    streaming = threading.Event()

    def stream() -> None:
        chunks = client.completions.create(model=model, prompt="Tell me a long story.", stream=True, max_tokens=400,
                                           temperature=0, extra_body={"ignore_eos": True})
        for _ in chunks:
            arrivals.append(time.monotonic())
            streaming.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert streaming.wait(60)
    conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=60)
    huge = "hello " * 1_250_000  # 7.5 MB
    attacks = [("/v1/completions", {"model": model, "prompt": huge, "max_tokens": 2}, "--max-chars-per-token"),
               ("/tokenize", {"model": model, "prompt": huge[:7_000_000]}, "--max-chars-per-token"),
               ("/v1/chat/completions", {"model": model, "max_tokens": 2,
                                         "messages": [{"role": "user", "content": "a"}] * 200_000}, "messages"),
               ("/v1/chat/completions", {"model": model, "max_tokens": 2, "messages": [
                   {"role": "user", "content": "b" * 1_000_000}]}, "--max-chars-per-token")]
    start = time.monotonic()
    for path, body, named in attacks:
        status, answer = _post(conn, path, body)
        assert status == 400, (path, answer)
        assert named in answer["error"]["message"] and answer["error"]["code"] == "limit_exceeded"
    end = time.monotonic()
    reader.join(120)
    during = [t for t in arrivals if start <= t <= end + STALL_BOUND]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if a <= end and b >= start]
    assert during and max(gaps) < STALL_BOUND, f"the stream stalled {max(gaps):.1f}s while huge inputs were refused"
    serve.wait_until_engine_idle()


def test_the_processor_refuses_unfit_prompts_itself_without_growing(serve: Serve):
    processor_pid = serve.services["processor"]["pid"]

    async def burst() -> list[str]:
        client = GrpcProcessorClient(serve.services["processor"]["address"], timeout=30,
                                     security=serve.credential("gateway"))
        errors = []
        try:
            for i in range(12):
                request = GenerateRequest(request_id=f"huge-{i}", params=SamplingParams(max_tokens=2),
                                          prompt="word " * 700_000)  # 3.5 MB: under gRPC's 4 MB message limit
                with pytest.raises(ValueError) as refused:
                    async for _ in client.generate(request):
                        pass
                errors.append(str(refused.value))
        finally:
            await client.close()
        return errors

    before = _rss_mb(processor_pid)
    start = time.monotonic()
    errors = asyncio.run(burst())
    assert all("characters" in e and "context" in e for e in errors), errors[0]
    assert time.monotonic() - start < 60
    assert _rss_mb(processor_pid) - before < 100, "the processor's memory grew with refused prompts"


def test_requests_over_the_sequence_limit_are_refused(serve: Serve):
    client = openai.OpenAI(base_url=serve.api, api_key="unused", timeout=60, max_retries=0)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="max-sequences-per-request"):
        client.completions.create(model=model, prompt=["a", "b", "c", "d", "e"], n=16, max_tokens=1)


def test_made_up_methods_and_paths_leave_the_metrics_series_flat(serve: Serve):
    rng = random.Random(11)
    conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=30)

    def junk(count: int) -> None:
        for _ in range(count):
            method = "".join(rng.choices(string.ascii_uppercase, k=rng.randint(3, 10)))
            path = "/" + "".join(rng.choices(string.ascii_lowercase + "/", k=rng.randint(1, 20)))
            conn.request(rng.choice([method, "GET", "DELETE"]), rng.choice([path, "/v1/models", "/health"]))
            conn.getresponse().read()

    junk(200)
    _http_series(serve)  # the scrape itself is a request: counted from the first one on
    series = _http_series(serve)
    junk(2800)
    after = _http_series(serve)
    assert after == series, f"{len(after - series)} new series, e.g. {sorted(after - series)[:3]}"


def _deep(levels: int) -> dict:
    value: dict = {"leaf": 1}
    for _ in range(levels):
        value = {"a": value}
    return value


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
BAD_INPUTS = {
    "nested message field": ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": "Hi", "extra": _deep(60)}]}),
    "nested chat_template_kwargs": ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"x": _deep(60)}}),
    "401-digit integer": ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": "Hi", "extra": int("9" * 401)}]}),
    "401-digit integer in /tokenize": ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}],
                                                     "chat_template_kwargs": {"x": int("9" * 401)}}),
    "NaN temperature": ("/v1/chat/completions", json.dumps(CHAT)[:-1] + ', "temperature": NaN}'),
    "NaN repetition_penalty": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "repetition_penalty": NaN}'),
    "Infinity top_p": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "top_p": Infinity}'),
    "-Infinity presence_penalty": ("/v1/chat/completions",
                                   json.dumps(CHAT)[:-1] + ', "presence_penalty": -Infinity}'),
    "NaN logit_bias": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "logit_bias": {"5": NaN}}'),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_a_400_and_the_connection_stays(serve: Serve, name: str):
    path, body = BAD_INPUTS[name]
    conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=60)
    conn.connect()
    sock = conn.sock
    status, answer = _post(conn, path, body)
    assert status == 400, answer
    message = answer["error"]["message"]
    assert "Error" not in message and "cmpl-" not in message and "Traceback" not in message, message
    status, answer = _post(conn, "/v1/chat/completions", CHAT)
    assert status == 200, answer
    assert conn.sock is sock, "the gateway closed the connection after the bad request"


def test_echo_with_logprobs_of_a_one_token_prompt(serve: Serve):
    conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=60)
    for prompt in ([1], "Hi"):
        status, answer = _post(conn, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 1,
                                                         "max_tokens": 2, "temperature": 0})
        assert status == 200, answer
        logprobs = answer["choices"][0]["logprobs"]
        assert logprobs["token_logprobs"][0] is None and len(logprobs["tokens"]) >= 2


def test_no_request_of_this_module_was_a_5xx(serve: Serve):
    page = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=30)
    page.request("GET", "/metrics")
    text = page.getresponse().read().decode()
    errors = [line for line in text.splitlines() if line.startswith("kvmesh_http_requests_total")
              and 'code="5' in line]
    assert not errors, errors
    assert "Traceback" not in serve.log(200_000)
