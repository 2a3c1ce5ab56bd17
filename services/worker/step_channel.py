"""The engine's step channel to its worker: one SchedulerOutput in, one ModelRunnerOutput out per
engine step, as length-prefixed protobuf frames on a socket of their own: TCP, or, for a worker
whose gRPC listens on a Unix socket (`kvmesh serve`), the Unix socket beside it (step_channel_path).

    engine-loop thread                                  worker's step thread (step_thread.py)
    StepChannel.step(): STEP frame ──── socket ────► select() wakes it: decode, execute_model,
    blocked in recv ◄─────────────────── socket ──── encode: OUTPUT frame (or ERROR)

Why not a gRPC call (the worker's other calls stay gRPC): a unary call crosses grpcio's threads on
both sides (the client's completion queue, the server's poller, its event loop, the hop to the step
thread and back) and each hand-off pays a vCPU wake-up; on a 2-core VM a call with nothing to do
costs 0.4-0.9 ms where this socket's round trip costs 20 us (docs/benchmarks/log.md, "The step
channel"). vLLM drives its workers over shared memory and ZMQ sockets for the same reason.

Frames: a 5-byte header (the payload's length, big-endian uint32; its kind, one byte), then the
payload, at most MAX_MESSAGE_BYTES (the gRPC services' limit):

    HELLO   engine -> worker, first, once: StepChannelHello (version, internal token, engine session)
    READY   worker -> engine: the hello is accepted (no payload)
    STEP    engine -> worker: a SchedulerOutput
    OUTPUT  worker -> engine: the step's ModelRunnerOutput
    ERROR   worker -> engine: a StepChannelError, the status a gRPC call would have ended with
            (services/common/errors.py): a refused hello, or a failed step (the channel stays open)

Security is the gRPC services': the internal token (compared in constant time) and, when the
internal channels use it, mutual TLS with the same certificates. Liveness stays with gRPC: the
engine's watchdog asks the worker's health service during a long step (services/worker/client.py)
and interrupts the channel when the worker stops answering.
"""

from __future__ import annotations

import enum
import logging
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError, Message

from services.common.errors import exception_of_status, status_of
from services.common.rpc.kvmesh.v1 import worker_pb2
from services.common.rpc.security import (
    PERMISSION_DENIED_MESSAGE,
    STEP_CHANNEL_METHOD,
    UNAUTHENTICATED_MESSAGE,
    RpcSecurity,
)
from services.common.rpc.server import MAX_MESSAGE_BYTES
from services.common.unix_socket import remove_stale_socket

logger = logging.getLogger(__name__)

VERSION = 1
HEADER = struct.Struct(">IB")
HANDSHAKE_TIMEOUT = 10.0  # seconds a new connection has for its TLS handshake and its hello
FRAME_TIMEOUT = 10.0  # seconds the rest of a frame may take once its first byte came (worker side)
MAX_HANDSHAKES = 8  # connections in their handshake at once; more are closed at once


class Frame(enum.IntEnum):
    HELLO = 1
    READY = 2
    STEP = 3
    OUTPUT = 4
    ERROR = 5


class ChannelClosed(ConnectionError):
    """The peer closed the channel (or the connection broke), before or inside a frame."""


def send_frame(sock: socket.socket, kind: Frame, payload: bytes = b"") -> None:
    sock.sendall(HEADER.pack(len(payload), kind) + payload)


def recv_frame(sock: socket.socket, max_bytes: int = MAX_MESSAGE_BYTES) -> tuple[Frame, bytearray]:
    """The next frame. ChannelClosed at the end of the stream; ValueError for a header that is not
    one of ours (an unknown kind, a payload over `max_bytes`)."""
    length, kind = HEADER.unpack(_recv_exactly(sock, HEADER.size))
    if kind not in Frame.__members__.values():
        raise ValueError(f"not a step-channel frame (kind {kind})")
    if length > max_bytes:
        raise ValueError(f"a step-channel frame of {length} bytes is over the limit of {max_bytes}")
    return Frame(kind), _recv_exactly(sock, length)


def _recv_exactly(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        count = sock.recv_into(view[got:])
        if not count:
            raise ChannelClosed("the step channel was closed")
        got += count
    return buffer


def parse(message: type[Message], payload: bytes | bytearray) -> Message:
    try:
        return message.FromString(payload)
    except DecodeError:
        raise ValueError(f"a step-channel frame is not a valid {message.DESCRIPTOR.name}") from None


def error_payload(exc: BaseException) -> bytes:
    """The ERROR frame's payload for `exc` (status_of: logs an exception outside the table)."""
    code, details = status_of(exc)
    return worker_pb2.StepChannelError(code=code.value[0], details=details).SerializeToString()


def exception_of_payload(payload: bytes | bytearray) -> Exception:
    error = parse(worker_pb2.StepChannelError, payload)
    code = next((c for c in grpc.StatusCode if c.value[0] == error.code), grpc.StatusCode.UNKNOWN)
    return exception_of_status(code, error.details or code.name)


def _no_delay(sock: socket.socket) -> None:
    if sock.family != socket.AF_UNIX:  # a Unix socket has no Nagle to turn off
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a frame goes out whole, at once


def step_channel_path(grpc_socket: Path) -> Path:
    """Where a worker whose gRPC listens on the Unix socket `grpc_socket` listens for its step
    channel: beside it, so that the engine needs no port from GetInfo and the socket shares the
    directory's protection."""
    return grpc_socket.with_name(grpc_socket.name + ".step")


# ----------------------------------------------------------------------------- the engine's side


class StepChannel:
    """The engine's end: `step()` from one thread at a time; `interrupt()` from any thread fails the
    step in flight (and every later one) with ChannelClosed."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    @classmethod
    def connect(cls, host: str, port: int, security: RpcSecurity, session: str, timeout: float) -> StepChannel:
        """Dial host:port, hello, wait for READY (within `timeout`). The worker's refusal raises its
        exception (a session that does not own the worker: EngineDeadError); no answer: ConnectionError."""
        sock = socket.create_connection((host, port), timeout=timeout)
        return cls._open(sock, f"{host}:{port}", security, security.server_name or host, session)

    @classmethod
    def connect_unix(cls, path: Path, security: RpcSecurity, session: str, timeout: float) -> StepChannel:
        """The same on the Unix socket at `path`; one that is not there: ConnectionError."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except OSError as exc:
            sock.close()
            raise ConnectionError(f"the step channel at {path} failed to open: {exc}") from None
        # gRPC's name for a unix: target, which certificates for a local worker name too.
        return cls._open(sock, str(path), security, security.server_name or "localhost", session)

    @classmethod
    def _open(cls, sock: socket.socket, where: str, security: RpcSecurity, server_name: str,
              session: str) -> StepChannel:
        try:
            _no_delay(sock)
            if security.tls:
                sock = security.ssl_context(server=False).wrap_socket(sock, server_hostname=server_name)
            hello = worker_pb2.StepChannelHello(version=VERSION, token=security.token or "", session=session)
            send_frame(sock, Frame.HELLO, hello.SerializeToString())
            kind, payload = recv_frame(sock)
        except (OSError, ValueError) as exc:
            sock.close()
            raise ConnectionError(f"the step channel to {where} failed to open: {exc}") from None
        if kind is not Frame.READY:
            sock.close()
            if kind is Frame.ERROR:
                raise exception_of_payload(payload)
            raise ConnectionError(f"the step channel to {where} answered its hello with {kind.name}")
        sock.settimeout(None)  # a step has no deadline (the watchdog judges liveness)
        return cls(sock)

    def step(self, scheduler_output: bytes) -> bytearray:
        """One round trip: the ModelRunnerOutput's bytes, or the worker's error raised as its exception
        (services/common/errors.py). ChannelClosed when the channel broke or was interrupted."""
        try:
            send_frame(self._sock, Frame.STEP, scheduler_output)
            kind, payload = recv_frame(self._sock)
        except ChannelClosed:
            raise
        except (OSError, ValueError) as exc:
            raise ChannelClosed(f"the step channel broke: {exc}") from None
        if kind is Frame.OUTPUT:
            return payload
        if kind is Frame.ERROR:
            raise exception_of_payload(payload)
        raise ChannelClosed(f"the worker answered a step with a {kind.name} frame")

    def interrupt(self) -> None:
        try:  # the socket's own shutdown, not SSLSocket's: a step may be reading on another thread
            socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.interrupt()
        self._sock.close()


# ----------------------------------------------------------------------------- the worker's side


def _listen_tcp(host: str, port: int) -> socket.socket:
    host = host.strip("[]")
    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    return socket.create_server((host, port), family=family, backlog=16,
                                dualstack_ipv6=family == socket.AF_INET6 and host in ("", "::"))


def _listen_unix(path: Path) -> socket.socket:
    remove_stale_socket(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        listener.listen(16)
    except OSError:
        listener.close()
        raise
    return listener


class StepChannelServer:
    """Listens on host:port (port 0: any free one; `port` says which), or on the Unix socket `path`
    (`port` 0; a socket a previous worker left there is replaced), and hands each connection,
    once its hello has an engine's token and `admit(session)` did not raise, to `adopt(sock, session)`.
    Each handshake runs on a thread of its own within HANDSHAKE_TIMEOUT, so a slow or silent client
    holds up no other; over MAX_HANDSHAKES at once, a new connection is closed at once."""

    def __init__(self, host: str, port: int, security: RpcSecurity, admit: Callable[[str], None],
                 adopt: Callable[[socket.socket, str], None], path: Path | None = None) -> None:
        self._security = security
        self._admit, self._adopt = admit, adopt
        self._ssl = security.ssl_context(server=True) if security.tls else None
        self._listener = _listen_tcp(host, port) if path is None else _listen_unix(path)
        self.port: int = self._listener.getsockname()[1] if path is None else 0
        self._path = path
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="step-channel-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                continue  # a connection reset before it was accepted
            if not self._handshakes.acquire(blocking=False):
                logger.warning("step channel: %s handshakes under way; closing a connection from %s",
                               MAX_HANDSHAKES, peer)
                sock.close()
                continue
            threading.Thread(target=self._handshake, args=(sock, peer), name="step-channel-hello",
                             daemon=True).start()

    def _handshake(self, sock: socket.socket, peer: object) -> None:
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            _no_delay(sock)
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(sock, server_side=True)
            kind, payload = recv_frame(sock, max_bytes=4096)
            if kind is not Frame.HELLO:
                raise ValueError(f"a step channel opens with HELLO, not {kind.name}")
            hello = parse(worker_pb2.StepChannelHello, payload)
            if hello.version != VERSION:
                raise ValueError(f"step channel version {hello.version}; this worker speaks {VERSION}")
            # An engine's token only (or the shared one): no other role drives a worker.
            code = self._security.authorize(hello.token, STEP_CHANNEL_METHOD)
            if code is not None:
                details = UNAUTHENTICATED_MESSAGE if code == grpc.StatusCode.UNAUTHENTICATED else \
                    PERMISSION_DENIED_MESSAGE.format(method=STEP_CHANNEL_METHOD)
                refusal = worker_pb2.StepChannelError(code=code.value[0], details=details)
                send_frame(sock, Frame.ERROR, refusal.SerializeToString())
                sock.close()
                return
            try:
                self._admit(hello.session)
            except Exception as exc:
                send_frame(sock, Frame.ERROR, error_payload(exc))
                sock.close()
                return
            send_frame(sock, Frame.READY)
            sock.settimeout(FRAME_TIMEOUT)
            self._adopt(sock, hello.session)
        except (OSError, ValueError, RuntimeError) as exc:  # RuntimeError: the step thread has stopped
            logger.warning("step channel: refused a connection from %s: %s", peer, exc)
            sock.close()
        finally:
            self._handshakes.release()

    def close(self) -> None:
        """Stop listening (connections already adopted are their owner's to close)."""
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        except OSError:
            pass
        self._listener.close()
        self._thread.join(timeout=5)
        if self._path is not None:
            self._path.unlink(missing_ok=True)
