"""The worker service: one device's model, KV cache and persistent batch behind gRPC.

    python -m services.worker.server --model smollm2 --port 50053 --kv-cache-memory 268435456

config -> Worker core -> WorkerServicer -> grpc.aio server (+ health, reflection) and the step
channel (services/worker/step_channel.py, on --step-port, or beside --unix-socket) -> SIGTERM ->
NOT_SERVING -> stop(grace) -> the step channels closed after the step in flight. Flags come from
services/common/config.py (ModelConfig, CacheConfig, WorkerConfig, ParallelConfig, ServingConfig);
each falls back to KVMESH_WORKER_<FIELD> (KVMESH_WORKER_PORT, ...).

A rank of a tensor-parallel group (`--tensor-parallel-size N --rank R --distributed-address
host:port`) serves the same way, on its own port; the engine calls every rank. When a collective
fails (a peer died or hung: GroupError, after at most --distributed-timeout) the call fails with
UNAVAILABLE and the worker stops and exits with status 1: its group is broken for good, and its
supervisor restarts it (with its peers) into a new one.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import grpc

from services.common.clients import WorkerClient
from services.common.config import (GATEWAY_LORA_FIELDS, CacheConfig, DisaggregationConfig, LoRAConfig, ModelConfig, ParallelConfig,
                                   SecurityConfig, ServingConfig, WorkerConfig)
from services.common.errors import EngineDeadError, answers_with_status
from services.common.flags import add_flags, build
from services.common.lora import check_adapter
from services.common.ports import DEFAULT_PORTS
from services.common.rpc import convert
from services.common.rpc.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.common.metrics import MetricsEndpoint, ServiceMetrics
from services.common.model_runner_output import ModelRunnerOutput
from services.common.rpc.security import ENGINE, RpcSecurity, read_role_tokens, read_token
from services.common.rpc.server import RpcServer, service_name
from services.common.scheduler_output import SchedulerOutput
from services.worker.client import SESSION_METADATA_KEY, InProcessWorkerClient
from services.worker.metrics import WorkerMetrics
from services.worker.parallel_group import GroupError
from services.worker.step_channel import (Frame, StepChannelServer, error_payload, parse, recv_frame, send_frame,
                                           step_channel_path)
from services.worker.step_thread import StepThread
from services.worker.worker import Worker

logger = logging.getLogger(__name__)

DEFAULT_PORT, DEFAULT_METRICS_PORT = DEFAULT_PORTS["worker"]
ENV_PREFIX = "KVMESH_WORKER"  # KVMESH_WORKER_PORT for --port, ...
T = TypeVar("T")
TRANSFER_THREADS = 8  # KV transfers in flight at once (each waits on its peer)
SERVICE_NAME = service_name(worker_pb2.DESCRIPTOR, "Worker")
GROUP_FAILED_EXIT_STATUS = 1  # the tensor-parallel group broke: restart this worker (and its peers)
MAX_STEP_CHANNELS = 4  # open at once; beyond it the oldest is closed (a session's newest replaces its older)


class WorkerClaimedError(EngineDeadError):
    """A mutating call from an engine session that does not own this worker. Travels as
    FAILED_PRECONDITION (EngineDeadError's row in services/common/errors.py)."""


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Converts proto <-> core and calls the in-process worker client. Every step and the cache set-up
    run on one dedicated thread (`step_thread`, a StepThread, which `main` also loads the model on):
    steps arrive on the step channel (services/worker/step_channel.py, on `step_port`), whose
    frames that thread reads itself, and gRPC calls are queued to it. So health checks, the engine's
    liveness checks during a step, are answered on the event loop while a long prefill chunk is
    computed, and one thread alone ever starts the process's OpenMP teams (services/worker/step_thread.py).
    Steps never overlap: there is one thread, and the engine sends one at a time.

    Ownership: a worker serves one engine. Each engine session (a random id its GrpcWorkerClient
    sends with every call, SESSION_METADATA_KEY, and in its step channel's hello) must claim the
    worker with InitializeCache; each call and step of the owner renews its lease. Then:
      - InitializeCache from another session while the owner's lease runs (it called within the
        last `owner_lease` seconds) is refused with FAILED_PRECONDITION before anything is touched:
        the KV cache and the persistent batch in use stay as they are;
      - once the lease has run out (the owner is gone: an engine pod restarted alone, or an engine
        idle that long; a step still running is not silence), InitializeCache from a new session takes the worker over: the cache is
        reallocated, every request of the old session forgotten, and the old session's later
        steps are refused (its engine fails and is restarted);
      - a step channel opens for the owner only, and a step of any session but the owner's is
        refused with FAILED_PRECONDITION.
    A restarted engine retries InitializeCache until its set-up deadline (GrpcWorkerClient), which
    is longer than the lease, so it takes over a worker whose old engine died without help. When
    `kvmesh serve` restarts an engine it restarts its worker too: a fresh worker has no owner.
    GetInfo changes nothing and is open to every caller with the internal token; from the owner it
    renews the lease (an idle engine that checks on its worker keeps it). The ownership state is
    shared by the event loop, the step thread and the channel's handshakes: under `_lock`."""

    def __init__(self, worker: WorkerClient, metrics: WorkerMetrics | None = None,
                 owner_lease: float = WorkerConfig.owner_lease,
                 on_group_failure: Callable[[], None] | None = None,
                 step_thread: StepThread | None = None, security: RpcSecurity = RpcSecurity(),
                 step_host: str = "127.0.0.1", step_port: int = 0, step_socket: Path | None = None) -> None:
        self.worker = worker
        self.on_group_failure = on_group_failure  # called once a collective has failed (GroupError), any thread
        self.group_failed = False
        self.metrics = metrics
        self.owner_lease = owner_lease
        self._own_thread = step_thread is None
        self._thread = step_thread or StepThread()
        # KV transfers wait on their peer for up to their timeout: never on the step thread.
        self._transfers = ThreadPoolExecutor(max_workers=TRANSFER_THREADS, thread_name_prefix="kv-transfer")
        self._lock = threading.Lock()
        self._owner: str | None = None  # the engine session that claimed the worker
        self._owner_seen = 0.0  # time.monotonic() of the owner's last call
        self._steps_in_flight = 0  # the owner's: a step longer than the lease is not silence
        self._channels: OrderedDict[socket.socket, str] = OrderedDict()  # step thread only: sock -> session
        # A channel's hello (on its handshake thread) opens it for the owner's session only.
        self._channel_server = StepChannelServer(step_host, step_port, security, self._check_owner, self._adopt,
                                                 step_socket)
        self.step_port = self._channel_server.port

    async def _call(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def _claim(self, session: str) -> None:
        now = time.monotonic()
        with self._lock:
            idle = 0.0 if self._steps_in_flight else now - self._owner_seen
            if self._owner not in (None, session) and idle < self.owner_lease:
                raise WorkerClaimedError(
                    f"this worker serves another engine (its last call was {idle:.1f}s ago); another engine may "
                    f"take it over once that one has been silent for {self.owner_lease:g}s")
            if self._owner not in (None, session):
                logger.warning("engine session %s takes this worker over from %s (silent for %.1fs)", session[:8],
                               self._owner[:8], idle)
            self._owner, self._owner_seen = session, now

    def _check_owner(self, session: str) -> None:
        with self._lock:
            if session != self._owner:
                raise WorkerClaimedError("this worker serves another engine" if self._owner is not None
                                         else "this worker has no KV cache yet: InitializeCache first")
            self._owner_seen = time.monotonic()

    @answers_with_status
    async def GetInfo(self, request: worker_pb2.GetWorkerInfoRequest, context) -> worker_pb2.WorkerInfo:
        with self._lock:
            if self._owner is not None and session_of(context) == self._owner:
                self._owner_seen = time.monotonic()  # an idle engine that asks keeps its worker
        return convert.worker_info_to_proto(replace(self.worker.get_info(), step_port=self.step_port))

    @answers_with_status
    async def InitializeCache(self, request: worker_pb2.InitializeCacheRequest,
                              context) -> worker_pb2.InitializeCacheResponse:
        self._claim(session_of(context))  # before anything is touched
        with self._group_guard():
            num_blocks = await self._call(self.worker.initialize_cache, request.max_num_reqs)
        return worker_pb2.InitializeCacheResponse(num_blocks=num_blocks)

    @answers_with_status
    async def SendKV(self, request: worker_pb2.KVTransfer, context) -> worker_pb2.KVTransferDone:
        return await self._transfer(self.worker.send_kv, request, context)

    @answers_with_status
    async def ReceiveKV(self, request: worker_pb2.KVTransfer, context) -> worker_pb2.KVTransferDone:
        return await self._transfer(self.worker.receive_kv, request, context)

    async def _transfer(self, move: Callable[[str, list[int], int], int], request: worker_pb2.KVTransfer,
                        context) -> worker_pb2.KVTransferDone:
        """On a thread of the transfer pool, beside the steps (KVTransferError: UNAVAILABLE)."""
        self._check_owner(session_of(context))
        num_bytes = await asyncio.get_running_loop().run_in_executor(
            self._transfers, move, request.peer, list(request.block_ids), request.tag)
        return worker_pb2.KVTransferDone(num_bytes=num_bytes)

    # ------------------------------------------------------------------ the step channel

    def _adopt(self, sock: socket.socket, session: str) -> None:
        self._thread.submit(self._watch_channel, sock, session)

    def _watch_channel(self, sock: socket.socket, session: str) -> None:
        """On the step thread: the session's newest channel replaces its older ones, and at most
        MAX_STEP_CHANNELS stay open (a taken-over engine's stays, to be told why its steps fail)."""
        for old, old_session in list(self._channels.items()):
            if old_session == session or len(self._channels) >= MAX_STEP_CHANNELS:
                self._drop_channel(old)
        self._channels[sock] = session
        self._thread.watch(sock, self._serve_frame)

    def _drop_channel(self, sock: socket.socket) -> None:
        self._thread.unwatch(sock)
        self._channels.pop(sock, None)
        sock.close()

    def _close_channels(self) -> None:
        for sock in list(self._channels):
            self._drop_channel(sock)

    def _serve_frame(self, sock: socket.socket) -> None:
        """On the step thread, when the channel has data: one step, answered with OUTPUT or ERROR (a
        failed step leaves the channel open, as a failed call left a gRPC channel). A closed or
        broken channel, or a frame that is not a step, closes it."""
        start = time.perf_counter()
        try:
            kind, payload = recv_frame(sock)
            if kind is not Frame.STEP:
                raise ValueError(f"a {kind.name} frame where a step was expected")
        except (OSError, ValueError) as exc:
            if not isinstance(exc, ConnectionError):
                logger.warning("step channel: %s; closing it", exc)
            self._drop_channel(sock)
            return
        try:
            kind, reply = Frame.OUTPUT, self._channel_step(self._channels[sock], payload)
        except Exception as exc:
            kind, reply = Frame.ERROR, error_payload(exc)  # logged there when outside the error table
        if self.metrics is not None:
            # Before the send: on loopback the send wakes the engine, which may take this core (and
            # this thread's time) for its own part of the step.
            self.metrics.observe_step_handling(time.perf_counter() - start, kind is Frame.OUTPUT)
        try:
            send_frame(sock, kind, reply)
        except OSError:
            self._drop_channel(sock)

    def _channel_step(self, session: str, payload: bytearray) -> bytes:
        # A failed step is logged with its traceback (status_of); the engine gets INTERNAL (UNAVAILABLE
        # when the tensor-parallel group failed: _group_guard).
        self._check_owner(session)  # renews the lease: no take-over between this and the count below
        with self._lock:
            self._steps_in_flight += 1
        try:
            scheduler_output = convert.scheduler_output_from_proto(parse(worker_pb2.SchedulerOutput, payload))
            with self._group_guard():
                runner_output = self._execute_model(scheduler_output)
            return convert.model_runner_output_to_proto(runner_output).SerializeToString()
        finally:
            with self._lock:
                self._steps_in_flight -= 1
                self._owner_seen = time.monotonic()

    async def close(self) -> None:
        """Stop listening for step channels, then close them once the step in flight is done."""
        self._channel_server.close()
        await self._call(self._close_channels)
        self._transfers.shutdown(wait=False)
        if self._own_thread:
            self._thread.shutdown(wait=False)

    @contextmanager
    def _group_guard(self) -> Iterator[None]:
        """A failed collective breaks the group for good: the call fails (the exception travels on)
        and the server is told to stop, so that the process exits and is restarted."""
        try:
            yield
        except GroupError:
            logger.error("the tensor-parallel group failed; this worker stops")
            self.group_failed = True
            if self.on_group_failure is not None:
                self.on_group_failure()
            raise

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The step, timed where it runs (no hand-off between threads counted)."""
        start = time.perf_counter()
        runner_output = self.worker.execute_model(scheduler_output)
        if self.metrics is not None:
            self.metrics.observe_step(time.perf_counter() - start)
        return runner_output


def session_of(context: grpc.aio.ServicerContext) -> str:
    """The caller's engine session ("" when it sent none: a session like any other)."""
    return next((value for key, value in context.invocation_metadata() or () if key == SESSION_METADATA_KEY), "")


async def serve(worker: WorkerClient, serving: ServingConfig, metrics: WorkerMetrics | None = None,
                security: RpcSecurity = RpcSecurity(), owner_lease: float = WorkerConfig.owner_lease,
                step_thread: StepThread | None = None, step_port: int = WorkerConfig.step_port) -> int:
    """Serve `worker` (computing on `step_thread`, a new one by default; its step channel on
    serving.host:step_port, or beside serving.unix_socket) until SIGTERM/SIGINT (exit status 0) or
    a failed tensor-parallel group (GROUP_FAILED_EXIT_STATUS), then NOT_SERVING, stop(grace), and
    the step channels closed once the step in flight is done."""
    loop = asyncio.get_running_loop()
    interceptors = [metrics.service.grpc.server_interceptor()] if metrics is not None else []
    if metrics is not None:
        security.refusals.register(metrics.service.registry)
    server = RpcServer(serving.host, serving.port, [SERVICE_NAME], interceptors, security, serving.unix_socket)
    step_socket = step_channel_path(serving.unix_socket) if serving.unix_socket is not None else None
    servicer = WorkerServicer(worker, metrics, owner_lease,
                              on_group_failure=lambda: loop.call_soon_threadsafe(server.request_termination),
                              step_thread=step_thread, security=security, step_host=serving.host,
                              step_port=step_port, step_socket=step_socket)
    try:
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server.server)
        await server.start()
        logger.info("step channel on %s", step_socket or f"{serving.host}:{servicer.step_port}")
        await server.wait_for_termination_signal()
        await server.shutdown(serving.grace, serving.drain)
    finally:
        await servicer.close()
    return GROUP_FAILED_EXIT_STATUS if servicer.group_failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh worker", description="The kvmesh worker service.")
    for config_class in (ModelConfig, CacheConfig, WorkerConfig, ParallelConfig, SecurityConfig):
        add_flags(parser, config_class, ENV_PREFIX)
    add_flags(parser, DisaggregationConfig, ENV_PREFIX, only=["kv_transfer_address", "kv_transfer_timeout"])
    add_flags(parser, ServingConfig, ENV_PREFIX, defaults={"port": DEFAULT_PORT, "metrics_port": DEFAULT_METRICS_PORT})
    add_flags(parser, LoRAConfig, ENV_PREFIX, exclude=GATEWAY_LORA_FIELDS)
    return parser


def build_lora(parser: argparse.ArgumentParser, args: argparse.Namespace) -> LoRAConfig:
    """The LoRA flags, each --lora-modules folder checked (a usage error, before the model loads; the
    worker checks the shapes once it has the model's config)."""
    lora = build(parser, LoRAConfig, args)
    try:
        for module in lora.lora_modules:
            check_adapter(module.path, lora.max_lora_rank)
    except ValueError as exc:
        parser.error(str(exc))
    return lora


def store_secret(config: SecurityConfig) -> str | None:
    """What guards this worker's torch.distributed stores: the shared token, else the engine's (every
    worker of a group, and every KV-transfer peer, is given one of them); None: the stores are open."""
    return read_token(config) or read_role_tokens(config).get(ENGINE)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    model_config, cache_config, worker_config, parallel_config, serving, security_config = (
        build(parser, c, args)
        for c in (ModelConfig, CacheConfig, WorkerConfig, ParallelConfig, ServingConfig, SecurityConfig))
    lora = build_lora(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s worker: %(message)s")
    security = RpcSecurity.load(security_config)  # before the model loads: a bad file fails at once
    step_thread = StepThread()  # the model loads where it will compute: one OpenMP team (step_thread.py)
    worker = step_thread.submit(Worker, model_config, cache_config, worker_config, parallel_config,
                                build(parser, DisaggregationConfig, args), store_secret(security_config),
                                lora=lora).result()
    metrics = WorkerMetrics(ServiceMetrics.create("worker"), model_config.served_model_name or worker.info.model_id)
    metrics.watch_forward(worker.model, worker.device)
    endpoint = MetricsEndpoint.start(metrics.service.registry, serving.host, serving.metrics_port)
    try:
        status = asyncio.run(serve(InProcessWorkerClient(worker, worker_config.max_num_seqs), serving, metrics,
                                   security, worker_config.owner_lease, step_thread, worker_config.step_port))
    finally:
        if endpoint is not None:
            endpoint.close()
    if status == 0:
        step_thread.submit(worker.close).result()  # a broken group is not left politely: its peers are gone
    step_thread.shutdown(wait=False)
    return status


if __name__ == "__main__":
    sys.exit(main())
