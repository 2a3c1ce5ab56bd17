"""The stack heals itself: a worker that dies (SIGKILL) or hangs (SIGSTOP) under `kvmesh serve` is
noticed within seconds, the streams in flight end with an error saying the engine stopped, /health
turns 503, the engine+worker pair is restarted with a back-off and /health is 200 again, and new
requests succeed; after --max-restarts within the window `kvmesh serve` gives up on that pair: the
other pairs serve on, and with none left it stops everything. Pairs that die together come back
together; a dead processor or gateway is restarted. A request whose own data the worker refuses
fails alone, and one in flight on two engines that died is failed rather than sent to a third. An
engine run on its own exits non-zero once its worker is gone (Kubernetes restarts it), and never
fails a step for being slow."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence

import httpx2 as httpx
import pytest
from grpc_health.v1 import health_pb2

from services.cli import RestartBudget
from services.common.engine_output import EngineCoreRequest
from services.common.errors import EngineDeadError
from services.common.metrics import fetch_page
from services.common.sampling_params import SamplingParams
from services.engine.client import GrpcEngineClient
from tests.services.procs import grpc_health_status, running_stack
from tests.services.procs import Serve, gone, serve_child_pid, serving, start_serve
from tests.unit.test_metrics import samples

pytestmark = pytest.mark.slow

ENDLESS = {"prompt": "Tell me a long story.", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}
# Fast enough for a test on a loaded 2-core machine; the defaults are 1 s / 5 s / 1 s.
LIVENESS = ["--worker-liveness-interval", "0.5", "--worker-liveness-timeout", "3", "--exit-grace", "0.5"]
RECOVERY_SECONDS = 120  # a fresh worker loads the model again; generous for a shared CPU



def stream_events_until(client: httpx.Client, fault: Callable[[], None], after: int = 3) -> tuple[list[str], float]:
    """Stream ENDLESS; after `after` events cause `fault()`; returns the events and how long after
    the fault the stream ended."""
    with client.stream("POST", "/v1/completions", json={**ENDLESS, "stream": True}) as response:
        assert response.status_code == 200
        events, faulted = [], None
        for line in response.iter_lines():
            if line:
                events.append(line)
            if len(events) == after and faulted is None:
                fault()
                faulted = time.monotonic()
    return events, time.monotonic() - faulted


def assert_error_event_then_done(events: list[str]) -> dict:
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["message"], events[-3:]
    return error


def wait_for_health(client: httpx.Client, status: int, timeout: float) -> float:
    """Seconds until /health answers `status`."""
    start = time.monotonic()
    while (code := client.get("/health").status_code) != status:
        assert time.monotonic() - start < timeout, f"/health still {code} after {timeout}s"
        time.sleep(0.2)
    return time.monotonic() - start


def assert_serves_a_chat(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.fixture(scope="module")
def serve(served_model: str) -> Iterator[Serve]:
    serve = start_serve(served_model, extra_args=[*LIVENESS, "--restart-backoff", "0.5"])
    try:
        yield serve
    finally:
        serve.kill()


@pytest.fixture(scope="module")
def client(serve: Serve) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=serve.api.removesuffix("/v1"), timeout=60) as client:
        yield client


def test_poisoned_request_fails_alone(serve: Serve, client: httpx.Client):
    """A NaN temperature sent straight to Engine.Generate (past every client-side check): that
    request gets INVALID_ARGUMENT (ValueError), a stream running beside it finishes, and the
    engine serves the next request. (A request the engine's checks let through but the worker
    cannot sample fails alone too: tests/faults/test_poisoned_sampling.py.)"""
    async def poison_beside_a_stream() -> tuple[str | None, BaseException | None]:
        engine = GrpcEngineClient(serve.services["engine"]["address"], timeout=10, security=serve.security)
        try:
            neighbour = EngineCoreRequest("neighbour", [1, 2, 3, 4], SamplingParams(max_tokens=24, ignore_eos=True,
                                                                                      temperature=0))
            params = SamplingParams(max_tokens=4)
            object.__setattr__(params, "temperature", math.nan)  # as a client that skips our checks sends it
            poisoned = EngineCoreRequest("poisoned", [1, 2, 3], params)

            async def run(request: EngineCoreRequest) -> str | None:
                finish = None
                async for output in engine.generate(request):
                    finish = output.finish_reason or finish
                return finish

            neighbour_task = asyncio.create_task(run(neighbour))
            await asyncio.sleep(0.3)  # the neighbour is running when the poison arrives
            poison_result = (await asyncio.gather(run(poisoned), return_exceptions=True))[0]
            return await neighbour_task, poison_result
        finally:
            await engine.close()

    neighbour_finish, poison_result = asyncio.run(poison_beside_a_stream())
    assert isinstance(poison_result, ValueError), poison_result
    assert neighbour_finish == "length"
    assert grpc_health_status(serve.services["engine"]["address"]) == health_pb2.HealthCheckResponse.SERVING
    assert client.get("/health").status_code == 200
    assert_serves_a_chat(client)


def test_killed_worker_ends_streams_then_the_pair_is_restarted(serve: Serve, client: httpx.Client):
    worker = serve_child_pid(serve, "worker")
    events, ended_after = stream_events_until(client, lambda: os.kill(worker, signal.SIGKILL))
    assert ended_after < 10, "a stream outlived its dead worker"
    error = assert_error_event_then_done(events)
    assert "engine" in error["message"], error
    wait_for_health(client, 503, timeout=10)
    wait_for_health(client, 200, timeout=RECOVERY_SECONDS)
    assert serve_child_pid(serve, "worker") != worker
    assert_serves_a_chat(client)
    assert serve.proc.poll() is None
    assert "restarting the worker and the engine" in serve.log()


def test_stopped_worker_is_detected_within_seconds_and_restarted(serve: Serve, client: httpx.Client):
    """SIGSTOP: the connection stays open, only the liveness check (3 s here) can tell."""
    wait_for_health(client, 200, timeout=RECOVERY_SECONDS)
    worker = serve_child_pid(serve, "worker")
    try:
        events, ended_after = stream_events_until(client, lambda: os.kill(worker, signal.SIGSTOP))
        assert ended_after < 20, f"a stuck worker held a stream {ended_after:.0f}s"
        assert_error_event_then_done(events)
        wait_for_health(client, 503, timeout=10)
        wait_for_health(client, 200, timeout=RECOVERY_SECONDS)
        assert gone(worker), "the stopped worker was left behind"
        assert_serves_a_chat(client)
    finally:
        if not gone(worker):
            os.kill(worker, signal.SIGKILL)


def test_restart_back_off_doubles_is_capped_and_forgets_old_restarts():
    budget = RestartBudget(backoff=1.0, backoff_max=5.0, max_restarts=4, window=100.0)
    assert [budget.next_delay(t) for t in (0, 1, 2, 3)] == [1.0, 2.0, 4.0, 5.0]
    assert budget.next_delay(4) is None  # a fifth within the window: give up
    assert budget.next_delay(150) == 1.0  # the old ones are out of the window: back to the start


def test_serve_gives_up_after_max_restarts(served_model: str):
    serve = start_serve(served_model, extra_args=[*LIVENESS, "--restart-backoff", "0.2", "--max-restarts", "1"])
    try:
        with httpx.Client(base_url=serve.api.removesuffix("/v1"), timeout=60) as client:
            os.kill(serve_child_pid(serve, "worker"), signal.SIGKILL)
            wait_for_health(client, 503, timeout=10)
            wait_for_health(client, 200, timeout=RECOVERY_SECONDS)
            pids = [serve_child_pid(serve, name) for name in ("worker", "engine", "processor", "gateway")]
            os.kill(pids[0], signal.SIGKILL)
            assert serve.proc.wait(30) == 1
            assert "giving up" in serve.log()
            assert all(gone(pid) for pid in pids), serve.log()
    finally:
        serve.kill()


# ----------------------------------------------------------------------------- an engine on its own


@pytest.fixture()
def engine_and_worker(served_model: str) -> Iterator[tuple]:
    """Function-scoped: the test kills the worker. Liveness checked every 0.2 s with a 1 s timeout,
    and no cut of prefill chunks, so that a 2,000-token step runs far longer than that."""
    with running_stack(worker=dict(model=served_model, dtype="float32", kv_cache_memory=128 * 2**20),
                       engine=dict(worker_liveness_interval=0.2, worker_liveness_timeout=1, exit_grace=0.5,
                                   target_step_seconds=0)) as (worker, engine, _, _):
        yield worker, engine


def test_engine_alone_survives_a_slow_step_and_exits_nonzero_when_its_worker_dies(engine_and_worker):
    worker, engine = engine_and_worker

    async def long_prefill() -> tuple[str | None, int]:
        client = GrpcEngineClient(engine.address, timeout=10)
        try:
            finish, tokens = None, 0
            prompt = [(i * 7919) % 40000 + 100 for i in range(2000)]  # one 2,000-token step: seconds on a CPU
            async for output in client.generate(EngineCoreRequest("long", prompt, SamplingParams(max_tokens=2))):
                finish, tokens = output.finish_reason or finish, tokens + len(output.new_token_ids)
            return finish, tokens
        finally:
            await client.close()

    assert asyncio.run(long_prefill()) == ("length", 2)
    assert engine.proc.poll() is None
    worker.kill()
    # Idle, the engine checks its worker every 0.2 s: NOT_SERVING, then exit 1 after its 0.5 s grace.
    deadline = time.monotonic() + 15
    while engine.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.proc.poll() == 1, engine.log()
    assert "exiting" in engine.log()


# ----------------------------------------------------------------------------- several pairs, one budget each

FLEET = ("engine-0", "engine-1", "engine-2")


@pytest.fixture(scope="module")
def fleet(served_model: str) -> Iterator[Serve]:
    """Three pairs, each allowed one restart; least-load routing (an idle engine takes a migrated stream).
    A context of 1,024 tokens: room for a stream that outlasts two kills."""
    yield from serving(served_model, ["--num-engines", str(len(FLEET)), "--max-model-len", "1024", *LIVENESS,
                                    "--restart-backoff", "0.5", "--max-restarts", "1", "--routing", "least-load"])





def busy_engines(fleet: Serve, names: Sequence[str]) -> list[str]:
    """Those of `names` running a request now (an engine that cannot be asked is not)."""
    async def running(name: str) -> int:
        client = GrpcEngineClient(fleet.services[name]["address"], timeout=3, security=fleet.security)
        try:
            return (await client.stats()).num_running
        except (ConnectionError, TimeoutError, EngineDeadError):
            return 0
        finally:
            await client.close()

    async def ask() -> list[int]:
        return list(await asyncio.gather(*(running(n) for n in names)))

    return [name for name, count in zip(names, asyncio.run(ask())) if count]


def the_busy_engine(fleet: Serve, names: Sequence[str], timeout: float = 30.0) -> str:
    """The one of `names` that runs the stream. Events of a killed engine may still be on their way
    while the processor moves the stream: the next engine runs it a moment later."""
    deadline = time.monotonic() + timeout
    while not (busy := busy_engines(fleet, names)):
        assert time.monotonic() < deadline, f"none of {names} runs the stream after {timeout}s"
        time.sleep(0.05)
    [engine] = busy
    return engine


def prompt_tokens(fleet: Serve, name: str) -> float:
    page = samples(fetch_page(fleet.services[name]["metrics"], 10))
    return sum(value for (metric, _), value in page.items() if metric == "vllm:prompt_tokens_total")


def wait_for_log(serve: Serve, text: str, timeout: float = RECOVERY_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while text not in serve.log(tail=100_000):
        assert serve.proc.poll() is None, serve.log()
        assert time.monotonic() < deadline, f"no {text!r} after {timeout}s:\n{serve.log()}"
        time.sleep(0.3)


def test_a_request_two_engines_died_under_is_failed_not_sent_to_a_third(fleet: Serve):
    """Poison-request guard: the stream's engine is killed, it moves to another, that one is killed
    too: the client gets an error saying so, and the third engine never sees the request. The two
    dead pairs are restarted at the same time, not one after the other."""
    prompt_tokens_before = {name: prompt_tokens(fleet, name) for name in FLEET}
    killed: list[str] = []
    with httpx.Client(base_url=fleet.api.removesuffix("/v1"), timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={**ENDLESS, "stream": True}) as response:
            assert response.status_code == 200
            events: list[str] = []
            for line in response.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(killed) < 2 and len(events) >= 3 * (len(killed) + 1):
                    engine = the_busy_engine(fleet, [n for n in FLEET if n not in killed])
                    os.kill(serve_child_pid(fleet, engine.replace("engine", "worker")), signal.SIGKILL)
                    killed.append(engine)
                    killed_at = len(events)
                # Tokens sent before the kill may still arrive; a stream moved a third time would go on.
                assert len(killed) < 2 or len(events) < killed_at + 100, "the stream went on after its second died"
    error = assert_error_event_then_done(events)
    assert "not sent to another" in error["message"], error
    [third] = [name for name in FLEET if name not in killed]
    assert prompt_tokens(fleet, third) == prompt_tokens_before[third]

    first, second = (name.removeprefix("engine-") for name in killed)
    wait_for_log(fleet, f"worker-{first} and engine-{first} are serving again")
    wait_for_log(fleet, f"worker-{second} and engine-{second} are serving again")
    log = fleet.log(tail=100_000)
    # Both restarts began before the first pair was back: neither waited for the other.
    assert log.index(f"restarting worker-{second} and engine-{second}") < log.index(
        f"worker-{first} and engine-{first} are serving again"), log


def test_a_pair_out_of_restarts_stays_down_and_the_others_serve_on(fleet: Serve):
    """--max-restarts 1: a pair that died twice within the window is given up, not the whole stack."""
    dead = next(name for name in FLEET if f"restarting worker-{name[-1]}" in fleet.log(tail=100_000))
    os.kill(serve_child_pid(fleet, dead.replace("engine", "worker")), signal.SIGKILL)
    wait_for_log(fleet, f"giving up on worker-{dead[-1]} and engine-{dead[-1]}, serving with 2 other engine(s)")
    with httpx.Client(base_url=fleet.api.removesuffix("/v1"), timeout=60) as client:
        wait_for_health(client, 200, timeout=30)
        for _ in range(3):  # whichever engine least-load picks, it is one that serves
            assert_serves_a_chat(client)
    assert fleet.proc.poll() is None


@pytest.mark.parametrize("service", ["processor", "gateway"])
def test_a_dead_processor_or_gateway_is_restarted(fleet: Serve, service: str):
    pid = serve_child_pid(fleet, service)
    os.kill(pid, signal.SIGKILL)
    wait_for_log(fleet, f"the {service} is serving again")
    with httpx.Client(base_url=fleet.api.removesuffix("/v1"), timeout=60) as client:
        wait_for_health(client, 200, timeout=30)
        assert_serves_a_chat(client)
    assert serve_child_pid(fleet, service) != pid and gone(pid)
    assert fleet.proc.poll() is None
