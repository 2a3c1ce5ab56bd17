"""The shell every kvmesh gRPC service shares: a `grpc.aio` server with the standard health
(`grpc.health.v1`) and reflection services, and the shutdown sequence

    SIGTERM/SIGINT -> health NOT_SERVING -> drain -> stop(grace) -> (the caller shuts its core down)

A service's `server.py` builds its core and servicer, then:

    server = RpcServer(host, port, [service_name(engine_pb2.DESCRIPTOR, "Engine")])   # or unix_socket=path
    engine_pb2_grpc.add_EngineServicer_to_server(servicer, server.server)
    await server.start()
    await server.wait_for_termination_signal()
    await server.shutdown(grace)
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.rpc.security import RpcSecurity
from services.common.unix_socket import remove_stale_socket, unix_address

logger = logging.getLogger(__name__)

# A step or a stream message can carry whole prompts and top-20 logprobs per prompt position;
# gRPC's default 4 MiB receive limit is too tight for long contexts.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# A channel whose server went away retries the connection with an exponential back-off (gRPC's
# default grows to 120 s); a restarted engine or worker is back at the same address within
# seconds, and its clients should see it within a second or two, not minutes.
MAX_RECONNECT_BACKOFF_MS = 2000
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def service_name(file_descriptor, name: str) -> str:
    """The fully qualified name of a service in a generated `*_pb2` module's DESCRIPTOR."""
    return file_descriptor.services_by_name[name].full_name


class RpcServer:
    """Construct inside the running event loop (grpc.aio binds to it). `security` decides who may
    call (services/common/rpc/security.py): its token interceptor runs before `interceptors`, so a
    refused call reaches no handler; without a token the server warns that it is open. With
    `unix_socket` it listens there instead of host:port (a socket a previous process left is
    replaced: a restarted service binds its old path again)."""

    def __init__(self, host: str, port: int, service_names: Sequence[str],
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 security: RpcSecurity = RpcSecurity(), unix_socket: Path | None = None) -> None:
        self.service_names = tuple(service_names)
        # Interceptors see every call, health and reflection included (kvmesh_grpc_server_*).
        self.server = grpc.aio.server(options=GRPC_OPTIONS,
                                      interceptors=[*security.server_interceptors(), *interceptors])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        if unix_socket is not None:
            remove_stale_socket(unix_socket)
        self.address = f"{host}:{port}" if unix_socket is None else unix_address(unix_socket)
        bound = security.add_port(self.server, self.address)
        if bound == 0:
            raise OSError(f"cannot listen on {self.address}")
        self.port = bound if unix_socket is None else 0  # grpc answers 1 for a socket: no port
        security.warn_if_open(", ".join(self.service_names))
        self._terminate = asyncio.Event()

    async def start(self) -> None:
        await self.server.start()
        await self.set_serving(True)
        logger.info("serving %s on %s", ", ".join(self.service_names), self.address)

    async def set_serving(self, serving: bool) -> None:
        """The overall status ("") and each service's follow the core's health."""
        status = SERVING if serving else NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def wait_for_termination_signal(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._terminate.set)
        try:
            await self._terminate.wait()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    def request_termination(self) -> None:
        self._terminate.set()

    async def shutdown(self, grace: float, drain: float = 0.0) -> None:
        """NOT_SERVING first, so health-checking callers stop sending; `drain` seconds for them to
        notice while new calls are still accepted; then refuse new calls and give in-flight ones
        `grace` seconds before they are cancelled."""
        await self.health.enter_graceful_shutdown()
        if drain > 0:
            await asyncio.sleep(drain)
        await self.server.stop(grace)
        logger.info("stopped %s", ", ".join(self.service_names))
