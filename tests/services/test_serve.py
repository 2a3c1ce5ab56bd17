"""`kvmesh serve` as a user runs it, driven by the official `openai` client: the same greedy text as
the in-process LLM, clients that go away free their KV blocks in the engine, SIGTERM during
traffic stops every process within 15 s, and the death of the processor stops the others."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from services import LLM, SamplingParams
from services.common.clients import EngineStats
from services.common.config import SecurityConfig
from services.common.rpc.security import RpcSecurity
from services.engine.client import GrpcEngineClient
from tests.services.procs import PYTHON, REPO_ROOT, free_port

pytestmark = pytest.mark.slow

KV_CACHE = "128MiB"
KV_BYTES = 128 * 2**20
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time, in a small village by the sea,"]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "user", "content": "Write a haiku about the sea."}]]
ENDLESS = {"max_tokens": 1000, "temperature": 0, "extra_body": {"ignore_eos": True}}


@dataclass
class Serve:
    proc: subprocess.Popen
    api: str
    services: dict[str, dict]  # name -> {"address": ..., "pid": ...}
    stderr_path: Path

    def log(self, tail: int = 6000) -> str:
        return self.stderr_path.read_text(errors="replace")[-tail:]

    @property
    def port(self) -> int:
        """The API's port."""
        return int(self.api.rsplit(":", 1)[1].split("/")[0])

    @property
    def child_pids(self) -> list[int]:
        return [s["pid"] for s in self.services.values()]

    @property
    def security(self) -> RpcSecurity:
        """The internal token serve gave its children: the file its gateway's argv names (only the
        same user may read it; the gateway, which is never restarted on its own)."""
        argv = Path(f"/proc/{self.services['gateway']['pid']}/cmdline").read_bytes().split(b"\0")
        path = Path(argv[argv.index(b"--internal-token-file") + 1].decode())
        return RpcSecurity.load(SecurityConfig(internal_token_file=path))

    def engine_stats(self) -> EngineStats:
        async def stats() -> EngineStats:
            client = GrpcEngineClient(self.services["engine"]["address"], timeout=5, security=self.security)
            try:
                return await client.stats()
            finally:
                await client.close()
        return asyncio.run(stats())

    def wait_until_engine_idle(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.engine_stats()
            if stats.num_running == stats.num_waiting == stats.num_used_blocks == 0:
                return
            assert time.monotonic() < deadline, f"the engine still holds requests: {stats}"
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL `kvmesh serve` and every child (each has a process group of its own)."""
        for pid in [self.proc.pid, *self.child_pids]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def start_serve(model_path: Path, timeout: float = 600.0, extra_args: Sequence[str] = (),
                env: Mapping[str, str] | None = None) -> Serve:
    """`extra_args` go to `kvmesh serve`; `env` is added to the environment of every service."""
    port = free_port()
    # stdout to a file, not a pipe: children share it, and a pipe nobody reads blocks them.
    stdout = tempfile.NamedTemporaryFile(prefix="kvmesh-serve-", suffix=".out", delete=False)
    stderr = tempfile.NamedTemporaryFile(prefix="kvmesh-serve-", suffix=".err", delete=False)
    proc = subprocess.Popen([PYTHON, "-m", "services.cli", "serve", "--model", str(model_path), "--port", str(port),
                             "--kv-cache-memory", KV_CACHE, "--print-addresses", *extra_args],
                            cwd=REPO_ROOT, stdout=stdout, stderr=stderr, start_new_session=True,
                            env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout
    out_path = Path(stdout.name)
    while True:
        for line in out_path.read_text(errors="replace").splitlines():
            if line.startswith('{"kvmesh"'):
                ready = json.loads(line)
                assert ready["api"] == f"http://127.0.0.1:{port}/v1"
                return Serve(proc, ready["api"], ready["services"], Path(stderr.name))
        if proc.poll() is not None or time.monotonic() > deadline:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it died by itself: say why below
            raise RuntimeError(f"kvmesh serve did not come up (exit {proc.poll()}):\n"
                               f"{Path(stderr.name).read_text(errors='replace')[-6000:]}")
        time.sleep(0.5)


def gone(pid: int) -> bool:
    """No such process, or a zombie (exited; only the reaping is left)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def serving(model_path: Path, extra_args: Sequence[str] = ()) -> Iterator[Serve]:
    """`kvmesh serve` for a module-scoped fixture (`yield from serving(...)`), killed at its end."""
    serve = start_serve(model_path, extra_args=extra_args)
    try:
        yield serve
    finally:
        serve.kill()


@pytest.fixture(scope="module")
def serve(model_path: Path) -> Iterator[Serve]:
    yield from serving(model_path)


@pytest.fixture(scope="module")
def offline(model_path: Path) -> Iterator[LLM]:
    llm = LLM(model=str(model_path), kv_cache_memory=KV_BYTES)
    yield llm
    del llm
    gc.collect()


def client_for(serve: Serve, timeout: float = 120.0) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=serve.api, api_key="unused", timeout=timeout, max_retries=0)
    return client, client.models.list().data[0].id


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


def test_sigterm_during_traffic_stops_everything_within_15s(serve: Serve):
    """Last in this module: it stops the module's `kvmesh serve`."""
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
    for result in results:
        assert result in ("length", "stop") or "shutting down" in str(result), (results, elapsed)


def test_serve_stops_the_others_when_the_processor_dies(model_path: Path):
    """The processor and the gateway are not restarted (a dead engine+worker pair is:
    tests/faults/test_supervision.py)."""
    serve = start_serve(model_path)
    try:
        os.kill(serve.services["processor"]["pid"], signal.SIGKILL)
        code = serve.proc.wait(20)
        assert code != 0
        assert all(gone(pid) for pid in serve.child_pids), serve.log()
    finally:
        serve.kill()


def test_children_stop_when_serve_itself_is_killed(model_path: Path):
    """SIGKILL leaves `kvmesh serve` no chance to stop anything: each child asked the kernel for a
    SIGTERM when its parent dies (the parent-death signal it sets on itself at start)."""
    serve = start_serve(model_path)
    try:
        serve.proc.send_signal(signal.SIGKILL)
        serve.proc.wait(5)
        deadline = time.monotonic() + 20
        while not all(gone(pid) for pid in serve.child_pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(gone(pid) for pid in serve.child_pids), serve.log()
    finally:
        serve.kill()
