"""What every kvmesh gRPC client does alike: a channel with the internal token (and mTLS), the
shared channel options and, where asked, the metrics interceptors; the standard health check;
closing.

    class GrpcEngineClient(AsyncGrpcClient):         # the asyncio clients (engine, processor)
        def __init__(...):
            super().__init__(address, security, metrics, timeout)
            self._stub = engine_pb2_grpc.EngineStub(self._channel)

    blocking_channel(address, security, metrics)     # the worker client (the engine's loop thread)
    health_status(channel, timeout)                  # blocking (the worker client, the probes)
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.metrics import GrpcMetrics
from services.common.rpc.security import RpcSecurity
from services.common.rpc.server import GRPC_OPTIONS, SERVING


def blocking_channel(address: str, security: RpcSecurity, metrics: GrpcMetrics | None) -> grpc.Channel:
    """A blocking channel whose unary calls `metrics` counts and times. Its caller passes
    `security.call_metadata` on each call: no token interceptor on the worker's step path."""
    channel = security.channel(address, GRPC_OPTIONS)
    return metrics.intercept_channel(channel) if metrics else channel


def health_status(channel: grpc.Channel, timeout: float, service: str = "") -> int:
    """The grpc.health.v1 status of `service` ("": the server's overall status); grpc.RpcError
    when the server does not answer within `timeout` seconds."""
    request = health_pb2.HealthCheckRequest(service=service)
    return health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout).status


class AsyncGrpcClient:
    """A grpc.aio channel to one service at `address`; `timeout` is the deadline of each unary call
    and of the health check, which asks about `health_service` ("": the server's overall status).
    Construct inside the running event loop."""

    def __init__(self, address: str, security: RpcSecurity, metrics: GrpcMetrics | None, timeout: float,
                 health_service: str = "") -> None:
        self.address = address
        self.timeout = timeout
        self._health_service = health_service
        self._channel = security.aio_channel(address, GRPC_OPTIONS,
                                             metrics.aio_client_interceptors() if metrics else ())
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def is_healthy(self) -> bool:
        """The service says SERVING; False also when it cannot be reached."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=self._health_service),
                                             timeout=self.timeout)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == SERVING

    async def close(self) -> None:
        await self._channel.close()
