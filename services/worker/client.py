"""WorkerClient implementations: the worker core in this process, or a worker server over gRPC and
its step channel.

The interface is blocking: an engine drives its worker from its engine-loop thread (see
services/engine/async_engine.py), where a blocking call is the shortest path there is: the step is
a send and a receive on the step channel's socket by that thread itself (services/worker/step_channel.py).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc

from services.common.clients import WorkerInfo
from services.common.errors import EngineDeadError, raising_errors
from services.common.metrics import GrpcMetrics
from services.common.model_runner_output import ModelRunnerOutput
from services.common.rpc import convert
from services.common.rpc.client import blocking_channel, health_status
from services.common.rpc.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.common.rpc.security import RpcSecurity
from services.common.rpc.server import SERVING
from services.common.scheduler_output import SchedulerOutput
from services.common.unix_socket import socket_path
from services.worker.step_channel import StepChannel, parse, step_channel_path

if TYPE_CHECKING:  # the gRPC client (the engine's side) must not pull in torch
    from services.worker.worker import Worker

logger = logging.getLogger(__name__)

# The metadata that names the engine session a worker call comes from (see WorkerServicer).
SESSION_METADATA_KEY = "kvmesh-engine-session"
CLAIM_RETRY_SECONDS = 1.0  # between InitializeCache attempts while another engine holds the worker


class InProcessWorkerClient:
    """The worker core in this process. Its calls run on the caller's thread, one at a time (the
    lock only guards against misuse: an engine never overlaps two steps). `max_num_reqs` caps the
    persistent batch an engine may ask for (None: no cap)."""

    def __init__(self, worker: Worker, max_num_reqs: int | None = None) -> None:
        self.worker = worker
        self.max_num_reqs = max_num_reqs
        self._lock = threading.Lock()

    def get_info(self) -> WorkerInfo:
        return self.worker.info

    def initialize_cache(self, max_num_reqs: int) -> int:
        if max_num_reqs < 1:
            raise ValueError(f"max_num_reqs must be positive, got {max_num_reqs}")
        if self.max_num_reqs is not None and max_num_reqs > self.max_num_reqs:
            raise ValueError(f"max_num_reqs {max_num_reqs} exceeds this worker's limit of {self.max_num_reqs}")
        with self._lock:
            num_blocks = self.worker.determine_num_blocks()
            self.worker.initialize_cache(num_blocks, max_num_reqs)
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        with self._lock:
            return self.worker.execute_model(scheduler_output)

    def send_kv(self, peer: str, block_ids: Sequence[int], tag: int) -> int:
        # No step lock: a transfer runs beside the steps, on blocks no scheduled request uses.
        return self.worker.send_kv(peer, list(block_ids), tag)

    def receive_kv(self, peer: str, block_ids: Sequence[int], tag: int) -> int:
        return self.worker.receive_kv(peer, list(block_ids), tag)

    def check_alive(self) -> None:
        pass  # in this process: alive as long as we are

    def close(self) -> None:
        pass


class GrpcWorkerClient:
    """A worker server: its set-up calls over gRPC, on a blocking channel, and its steps over its
    step channel (services/worker/step_channel.py), opened at the first step on the host of
    `address` and the port GetInfo names (beside the socket of a `unix:` address). The set-up
    calls have a deadline, `timeout` (they also wait for the worker to come up). A step has none:
    a long prefill on a CPU may take minutes, and slow is not dead. Instead a watchdog thread asks
    the worker's health service (gRPC), every `liveness_interval` seconds while a step has been in
    flight that long, for an answer within `liveness_timeout`:

        engine-loop thread:  step on the step channel (blocking, no deadline) ─────► reply
        watchdog thread:        │ step in flight >= interval: Health.Check (timeout) ─► SERVING? go on
                                └─ no answer (a stuck worker: SIGSTOP, a hung device) ─► interrupt
                                   the step channel: the step fails with ConnectionError

    A worker that is gone (connection refused or reset) fails the step at once, with
    ConnectionError, and so does every later step: an engine whose worker failed is restarted. The
    worker answers health from its event loop while a prefill chunk runs on its step thread
    (services/worker/server.py), so a busy worker stays alive. The watchdog costs the step two
    attribute writes. Errors are those of services/common/errors.py, as for every client.

    Each client is one engine session, a random id sent with every call next to the internal token
    (`security`), and in the step channel's hello: the worker serves only the session that claimed
    it with InitializeCache. While another session still holds the worker, initialize_cache retries
    until `timeout` (the other engine's lease runs out if it is gone; WorkerServicer)."""

    def __init__(self, address: str, timeout: float = 60.0, liveness_interval: float = 1.0,
                 liveness_timeout: float = 5.0, metrics: GrpcMetrics | None = None,
                 security: RpcSecurity = RpcSecurity()) -> None:
        self.address = address
        self.timeout = timeout
        self.liveness_interval = liveness_interval
        self.liveness_timeout = liveness_timeout
        self.session = secrets.token_hex(16)
        self._security = security
        # Passed on each call: no interceptor on the step, the hottest call there is.
        self._metadata = (*security.call_metadata, (SESSION_METADATA_KEY, self.session))
        self._channel = blocking_channel(address, security, metrics)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._step_channel: StepChannel | None = None  # opened at the first step
        self._step_port: int | None = None  # from GetInfo
        self._step_since: float | None = None  # monotonic start of the step in flight
        self._failure: str | None = None  # why the watchdog cut the channels
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="worker-liveness", daemon=True).start()

    def get_info(self) -> WorkerInfo:
        with raising_errors():
            reply = self._stub.GetInfo(worker_pb2.GetWorkerInfoRequest(), timeout=self.timeout, wait_for_ready=True,
                                       metadata=self._metadata)
        info = convert.worker_info_from_proto(reply)
        self._step_port = info.step_port
        return info

    def initialize_cache(self, max_num_reqs: int) -> int:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                with raising_errors():
                    reply = self._stub.InitializeCache(worker_pb2.InitializeCacheRequest(max_num_reqs=max_num_reqs),
                                                       timeout=self.timeout, wait_for_ready=True,
                                                       metadata=self._metadata)
                return reply.num_blocks
            except EngineDeadError as exc:  # FAILED_PRECONDITION: another engine session holds the worker
                if time.monotonic() + CLAIM_RETRY_SECONDS > deadline:
                    raise
                logger.warning("worker %s: %s; retrying", self.address, exc)
                time.sleep(CLAIM_RETRY_SECONDS)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._failure is not None:
            raise ConnectionError(self._failure)
        channel = self._step_channel or self._open_step_channel()
        request = convert.scheduler_output_to_proto(scheduler_output).SerializeToString()
        self._step_since = time.monotonic()
        try:
            reply = channel.step(request)
        except ConnectionError as exc:  # the channel is gone (the worker, or the watchdog, closed it)
            self._failure = self._failure or f"the worker at {self.address} failed its step: {exc}"
            raise ConnectionError(self._failure) from None
        finally:
            self._step_since = None
        return convert.model_runner_output_from_proto(parse(worker_pb2.ModelRunnerOutput, reply))

    def _open_step_channel(self) -> StepChannel:
        """Dial the worker's step channel (within `timeout`). A session that does not own the worker
        is refused (EngineDeadError) and opens no channel; it may try again after InitializeCache."""
        if self._step_port is None:
            try:
                self.get_info()
            except TimeoutError as exc:  # not up within `timeout`: for a step, unreachable
                raise ConnectionError(f"the worker at {self.address} is unreachable: {exc}") from None
        self._step_channel = self._dial_step_channel()
        if self._closed.is_set():  # closed meanwhile by another thread
            self._step_channel.close()
        return self._step_channel

    def _dial_step_channel(self) -> StepChannel:
        """Beside the worker's Unix socket, or on its host at the port GetInfo named."""
        grpc_socket = socket_path(self.address)
        if grpc_socket is not None:
            return StepChannel.connect_unix(step_channel_path(grpc_socket), self._security, self.session,
                                            self.timeout)
        host = self.address.rpartition(":")[0].strip("[]")
        return StepChannel.connect(host, self._step_port, self._security, self.session, self.timeout)

    def send_kv(self, peer: str, block_ids: Sequence[int], tag: int) -> int:
        """Deadline `timeout`: the worker's own transfer timeout (seconds) ends it well before."""
        with raising_errors():
            reply = self._stub.SendKV(worker_pb2.KVTransfer(peer=peer, block_ids=block_ids, tag=tag),
                                      timeout=self.timeout, metadata=self._metadata)
        return reply.num_bytes

    def receive_kv(self, peer: str, block_ids: Sequence[int], tag: int) -> int:
        with raising_errors():
            reply = self._stub.ReceiveKV(worker_pb2.KVTransfer(peer=peer, block_ids=block_ids, tag=tag),
                                         timeout=self.timeout, metadata=self._metadata)
        return reply.num_bytes

    def check_alive(self) -> None:
        """Health, then, between steps, GetInfo as this session: the worker renews the lease of the
        session that owns it on GetInfo only (a health check names no session), so an idle engine
        that checks keeps its worker. During a step the step itself holds the lease."""
        try:
            status = health_status(self._channel, self.liveness_timeout)
            if status == SERVING and self._step_since is None:
                self._stub.GetInfo(worker_pb2.GetWorkerInfoRequest(), timeout=self.liveness_timeout,
                                   metadata=self._metadata)
        except grpc.RpcError as error:
            raise ConnectionError(f"the worker at {self.address} failed its liveness check "
                                  f"({error.code().name}, {self.liveness_timeout:g}s)") from None
        if status != SERVING:
            raise ConnectionError(f"the worker at {self.address} is not serving")

    def _watch(self) -> None:
        """The watchdog thread: until close(), check the worker during each long step; on a failed
        check during the same step, close the channel (which fails the step) and stop."""
        while not self._closed.wait(self.liveness_interval):
            since = self._step_since
            if since is None or time.monotonic() - since < self.liveness_interval:
                continue
            try:
                self.check_alive()
            except ConnectionError as exc:
                if self._step_since == since:  # not a later step's: that one gets its own check
                    self._failure = str(exc)
                    if self._step_channel is not None:
                        self._step_channel.interrupt()
                    self._channel.close()
                    return

    def close(self) -> None:
        self._closed.set()
        if self._step_channel is not None:
            self._step_channel.close()
        self._channel.close()
