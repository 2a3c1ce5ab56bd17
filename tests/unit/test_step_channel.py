"""The worker's step channel (services/worker/step_channel.py) and its step thread
(services/worker/step_thread.py): frames, ownership, bad input, interruption and shutdown, against
the real WorkerServicer on a real grpc.aio server and real sockets on 127.0.0.1. No model: the core
is a stand-in that samples TOKEN for every scheduled request and notes the thread it ran on.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from services.common.clients import WorkerInfo
from services.common.errors import EngineDeadError
from services.common.model_runner_output import ModelRunnerOutput
from services.common.rpc.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.common.rpc.security import RpcSecurity
from services.common.rpc.server import RpcServer
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import NewRequestData, SchedulerOutput
from services.worker.client import GrpcWorkerClient, InProcessWorkerClient
from services.worker.server import WorkerServicer
from services.worker.step_channel import (HEADER, VERSION, ChannelClosed, Frame, StepChannel, recv_frame,
                                         send_frame)
from services.worker.step_thread import StepThread

pytestmark = pytest.mark.anyio

TOKEN = 1000
INFO = WorkerInfo(model_id="fake", model_path="/nowhere", vocab_size=49152, max_model_len=1 << 17, block_size=16)


class ThreadNotingCore:
    """Stands in for services.worker.worker.Worker: samples TOKEN for every scheduled request after
    `step_delay` seconds, and notes which thread each call ran on and the prompts it was given."""

    info = INFO

    def __init__(self, step_delay: float = 0.0) -> None:
        self.step_delay = step_delay
        self.threads: set[int] = set()
        self.prompts: list[list[int]] = []

    def determine_num_blocks(self) -> int:
        self.threads.add(threading.get_ident())
        return 64

    def initialize_cache(self, num_blocks: int, max_num_reqs: int) -> None:
        self.threads.add(threading.get_ident())

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.threads.add(threading.get_ident())
        self.prompts += [r.prompt_token_ids for r in out.scheduled_new_reqs]
        time.sleep(self.step_delay)
        req_ids = list(out.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids, [TOKEN] * len(req_ids))


def new_request(req_id: str, prompt_len: int = 3) -> SchedulerOutput:
    new = NewRequestData(req_id=req_id, prompt_token_ids=list(range(prompt_len)), output_token_ids=[],
                         sampling_params=SamplingParams(temperature=0), stop_token_ids=frozenset(),
                         block_ids=[0], num_computed_tokens=0)
    return SchedulerOutput([new], [], {req_id: prompt_len}, prompt_len)


@asynccontextmanager
async def worker_server(core: ThreadNotingCore,
                        owner_lease: float = 15.0) -> AsyncIterator[tuple[str, WorkerServicer]]:
    server = RpcServer("127.0.0.1", 0, [])
    servicer = WorkerServicer(InProcessWorkerClient(core), owner_lease=owner_lease)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server.server)
    await server.start()
    try:
        yield f"127.0.0.1:{server.port}", servicer
    finally:
        await server.server.stop(0)
        await servicer.close()


@asynccontextmanager
async def owner_with_channel(core: ThreadNotingCore) -> AsyncIterator[tuple[GrpcWorkerClient, StepChannel]]:
    """An engine's client that owns the worker, and a step channel of its session opened by hand."""
    async with worker_server(core) as (address, servicer):
        client = GrpcWorkerClient(address, timeout=5)
        try:
            await asyncio.to_thread(client.initialize_cache, 4)
            channel = await asyncio.to_thread(StepChannel.connect, "127.0.0.1", servicer.step_port, RpcSecurity(),
                                              client.session, 5)
            try:
                yield client, channel
            finally:
                channel.close()
        finally:
            client.close()


# ----------------------------------------------------------------------------- frames


def test_frames_cross_whole_and_a_foreign_header_is_refused():
    a, b = socket.socketpair()
    with a, b:
        payload = bytes(range(256)) * 4096  # 1 MiB: more than one socket buffer
        sender = threading.Thread(target=send_frame, args=(a, Frame.STEP, payload))
        sender.start()
        assert recv_frame(b) == (Frame.STEP, payload)
        sender.join()
        send_frame(a, Frame.READY)
        assert recv_frame(b) == (Frame.READY, b"")
        a.sendall(HEADER.pack(0, 99))
        with pytest.raises(ValueError, match="kind 99"):
            recv_frame(b)
        a.sendall(HEADER.pack(1 << 30, Frame.STEP))
        with pytest.raises(ValueError, match="over the limit"):
            recv_frame(b)
        a.sendall(HEADER.pack(10, Frame.STEP) + b"short")
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ChannelClosed):
            recv_frame(b)


# ----------------------------------------------------------------------------- the step thread


def test_the_step_thread_runs_calls_in_order_then_stops():
    thread = StepThread()
    ran: list[tuple[int, int]] = []
    futures = [thread.submit(lambda i=i: ran.append((i, threading.get_ident()))) for i in range(50)]
    thread.shutdown(wait=True)  # the calls already queued run first
    assert all(f.done() and f.exception() is None for f in futures)
    assert [i for i, _ in ran] == list(range(50)) and len({t for _, t in ran}) == 1
    assert ran[0][1] != threading.get_ident()
    with pytest.raises(RuntimeError, match="after shutdown"):
        thread.submit(print)


def test_a_failing_socket_handler_is_unwatched_and_the_thread_goes_on():
    thread = StepThread()
    a, b = socket.socketpair()
    calls = []

    def handler(sock: socket.socket) -> None:
        calls.append(sock.recv(16))
        raise RuntimeError("a broken handler")
    try:
        thread.watch(b, handler).result(timeout=5)
        a.sendall(b"first")
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        a.sendall(b"second")  # no longer watched: never read
        assert thread.submit(lambda: 42).result(timeout=5) == 42
        assert calls == [b"first"]
        assert thread.submit(thread.watched).result(timeout=5) == []
    finally:
        thread.shutdown()
        a.close()
        b.close()


def test_a_socket_closed_earlier_in_the_same_round_is_skipped_and_the_thread_lives_on():
    # The worker's case: a session's new channel (a queued call) replaces its old one while the old
    # one's end of stream waits in the same select() round.
    thread = StepThread()
    pairs = [socket.socketpair() for _ in range(3)]
    ran: list[int] = []
    release = threading.Event()

    def close_others(i: int):
        def handler(sock: socket.socket) -> None:
            ran.append(i)
            sock.recv(16)
            for j, (_, other) in enumerate(pairs[:2]):
                if j != i:
                    thread.unwatch(other)
                    other.close()
        return handler
    try:
        for i, (_, theirs) in enumerate(pairs[:2]):
            thread.watch(theirs, close_others(i)).result(timeout=5)
        thread.watch(pairs[2][1], lambda sock: ran.append(2)).result(timeout=5)
        busy = thread.submit(release.wait, 5)  # both sockets become readable while the thread is busy
        for mine, _ in pairs:
            mine.sendall(b"x")
        closer = thread.submit(lambda: (thread.unwatch(pairs[2][1]), pairs[2][1].close()))
        release.set()
        busy.result(timeout=5)
        closer.result(timeout=5)
        assert thread.submit(lambda: 42).result(timeout=5) == 42  # alive
        assert len([i for i in ran if i < 2]) == 1  # whichever ran first closed the other
    finally:
        thread.shutdown()
        for mine, theirs in pairs:
            mine.close()
            theirs.close()


# ----------------------------------------------------------------------------- the worker's channel


async def test_calls_and_steps_run_on_one_thread_and_a_large_step_crosses_whole():
    # One thread starts every OpenMP team of the worker process (services/worker/step_thread.py).
    core = ThreadNotingCore()
    async with worker_server(core) as (address, _):
        client = GrpcWorkerClient(address, timeout=5)
        try:
            assert await asyncio.to_thread(client.initialize_cache, 4) == 64
            long_prompt = 100_000  # ~300 KB on the wire
            for req_id, step in (("a", new_request("a")), ("b", new_request("b", long_prompt))):
                assert await asyncio.to_thread(client.execute_model, step) == ModelRunnerOutput([req_id], [TOKEN])
        finally:
            client.close()
    assert len(core.threads) == 1 and threading.get_ident() not in core.threads
    assert core.prompts[1] == list(range(long_prompt))


async def test_a_malformed_step_is_invalid_argument_and_the_channel_serves_on():
    async with owner_with_channel(ThreadNotingCore()) as (client, channel):
        with pytest.raises(ValueError, match="not a valid SchedulerOutput"):
            await asyncio.to_thread(channel.step, b"\xff\xff\xff not a protobuf")
        reply = await asyncio.to_thread(channel.step, b"")  # an empty step is a valid one
        assert list(worker_pb2.ModelRunnerOutput.FromString(bytes(reply)).req_ids) == []
        # The same session's newest channel replaced the first one (closed by the worker).
        assert (await asyncio.to_thread(client.execute_model, new_request("r"))).req_ids == ["r"]
        with pytest.raises(ConnectionError):
            await asyncio.to_thread(channel.step, b"")


async def test_a_session_that_does_not_own_the_worker_gets_no_step_through():
    async with worker_server(ThreadNotingCore(), owner_lease=0.0) as (address, servicer):
        old, new = GrpcWorkerClient(address, timeout=5), GrpcWorkerClient(address, timeout=5)
        try:
            with pytest.raises(EngineDeadError, match="InitializeCache first"):  # nobody owns it yet
                await asyncio.to_thread(old.execute_model, new_request("r"))
            await asyncio.to_thread(old.initialize_cache, 4)
            await asyncio.to_thread(old.execute_model, new_request("r"))
            await asyncio.to_thread(new.initialize_cache, 4)  # the lease is 0 s: taken over at once
            # The old session's open channel is told why its steps fail; the new one steps.
            with pytest.raises(EngineDeadError, match="another engine"):
                await asyncio.to_thread(old.execute_model, new_request("s"))
            assert (await asyncio.to_thread(new.execute_model, new_request("t"))).req_ids == ["t"]
        finally:
            old.close()
            new.close()


@pytest.mark.slow  # over a second: `make test`, not test-fast
async def test_an_interrupted_step_fails_at_once_and_the_worker_serves_a_new_channel():
    # The engine's watchdog interrupts the channel of a worker that stopped answering its liveness
    # checks (services/worker/client.py); here the step is just slow.
    core = ThreadNotingCore(step_delay=2.0)
    async with owner_with_channel(core) as (client, channel):
        step = asyncio.create_task(asyncio.to_thread(channel.step, b""))
        await asyncio.sleep(0.2)
        start = time.monotonic()
        channel.interrupt()
        with pytest.raises(ChannelClosed):
            await step
        assert time.monotonic() - start < 1.5  # not when the step ends
        core.step_delay = 0.0
        assert (await asyncio.to_thread(client.execute_model, new_request("r"))).req_ids == ["r"]


@pytest.mark.slow  # over a second: `make test`, not test-fast
async def test_a_stopping_worker_finishes_the_step_in_flight_then_closes_its_channels():
    core = ThreadNotingCore(step_delay=0.5)
    client = None
    async with worker_server(core) as (address, servicer):
        client = GrpcWorkerClient(address, timeout=5)
        await asyncio.to_thread(client.initialize_cache, 4)
        await asyncio.to_thread(client.execute_model, new_request("warm"))
        step = asyncio.create_task(asyncio.to_thread(client.execute_model, new_request("r")))
        await asyncio.sleep(0.1)
    # worker_server's exit closed the servicer: the step in flight got its answer first.
    assert (await step).req_ids == ["r"]
    with pytest.raises(ConnectionError):
        await asyncio.to_thread(client.execute_model, new_request("s"))
    with pytest.raises(ConnectionError):  # the port no longer listens
        socket.create_connection(("127.0.0.1", servicer.step_port), timeout=2).close()
    client.close()


async def test_a_hello_of_another_version_is_refused():
    async with worker_server(ThreadNotingCore()) as (_, servicer):
        with socket.create_connection(("127.0.0.1", servicer.step_port), timeout=5) as sock:
            hello = worker_pb2.StepChannelHello(version=VERSION + 1, session="s").SerializeToString()
            send_frame(sock, Frame.HELLO, hello)
            with pytest.raises(ChannelClosed):  # closed without READY: the worker's log says why
                await asyncio.to_thread(recv_frame, sock)
