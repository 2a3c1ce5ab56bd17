"""The engine service: scheduler, KV-cache manager and prefix cache driving a worker over gRPC.

    python -m services.engine.server --worker-address 127.0.0.1:50053 --port 50052
    python -m services.engine.server --worker-service kvmesh-worker    # in Kubernetes: pod kvmesh-engine-N
                                                                       # pairs with kvmesh-worker-N

config -> GrpcWorkerClient (blocking; the engine-loop thread calls it) -> AsyncEngine ->
EngineServicer -> grpc.aio server (+ health, reflection) -> SIGTERM -> NOT_SERVING -> drain ->
stop(grace) -> engine shutdown. Health follows the engine: NOT_SERVING as soon as its worker fails
(gone, stuck, or a failed step), and the process exits 1 after --exit-grace, so that its supervisor
restarts it with its worker.
The block size is the worker's (WorkerInfo). Flags come from services/common/config.py
(EngineServiceConfig, SchedulerConfig, ServingConfig); each falls back to KVMESH_ENGINE_<FIELD>
(KVMESH_ENGINE_PORT, KVMESH_ENGINE_WORKER_ADDRESS, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
from contextlib import aclosing
from dataclasses import replace
from typing import NamedTuple


from services.common.clients import EngineClient
from services.common.config import (
    EngineServiceConfig,
    ModelConfig,
    PrefixIndexConfig,
    SchedulerConfig,
    SecurityConfig,
    ServingConfig,
)
from services.common.flags import add_flags, build
from services.common.discovery import EndpointWatcher, kube_configuration
from services.common.errors import answers_with_status
from services.common.metrics import MetricsEndpoint, ServiceMetrics
from services.common.rpc import convert
from services.common.rpc.kvmesh.v1 import engine_pb2, engine_pb2_grpc
from services.common.rpc.security import RpcSecurity
from services.common.rpc.server import RpcServer, service_name
from services.engine.async_engine import AsyncEngine
from services.engine.metrics import EngineLabels, EngineMetrics
from services.worker.client import GrpcWorkerClient

logger = logging.getLogger(__name__)

DEFAULT_PORT = 50052
DEFAULT_METRICS_PORT = 9052
DEFAULT_WORKER_ADDRESS = "127.0.0.1:50053"
ENV_PREFIX = "KVMESH_ENGINE"  # KVMESH_ENGINE_PORT for --port, ...
SERVICE_NAME = service_name(engine_pb2.DESCRIPTOR, "Engine")


class EngineServicer(engine_pb2_grpc.EngineServicer):
    """Converts proto <-> core and calls the engine; its errors end the call with their status
    (services/common/errors.py)."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    @answers_with_status
    async def Generate(self, request: engine_pb2.EngineRequest, context):
        # A cancelled call (the caller went away) cancels this coroutine at an await; closing the
        # stream then aborts the request in the engine.
        async with aclosing(self.engine.generate(convert.engine_request_from_proto(request))) as stream:
            async for output in stream:
                yield convert.engine_output_to_proto(output)

    @answers_with_status
    async def Abort(self, request: engine_pb2.AbortRequest, context) -> engine_pb2.AbortResponse:
        await self.engine.abort(list(request.request_ids), request.reason or "abort")
        return engine_pb2.AbortResponse()

    @answers_with_status
    async def GetStats(self, request: engine_pb2.GetStatsRequest, context) -> engine_pb2.EngineStats:
        return convert.engine_stats_to_proto(await self.engine.stats())

    @answers_with_status
    async def GetInfo(self, request: engine_pb2.GetEngineInfoRequest, context) -> engine_pb2.EngineInfo:
        return convert.engine_info_to_proto(await self.engine.info())

    @answers_with_status
    async def MatchPrefix(self, request: engine_pb2.MatchPrefixRequest, context) -> engine_pb2.MatchPrefixResponse:
        return convert.prefix_match_to_proto(await self.engine.match_prefix(convert.block_hashes_from_proto(request)))


async def follow_engine_health(engine: AsyncEngine, server: RpcServer, exit_grace: float = 1.0) -> None:
    """Once the engine is dead (it does not recover): NOT_SERVING at once, `exit_grace` seconds for
    open streams to carry their EngineDeadError out, then the server's termination (serve() returns
    False: the process exits non-zero and its supervisor restarts it, with its worker)."""
    await engine.wait_until_unhealthy()
    logger.error("engine dead: health is NOT_SERVING; exiting in %gs", exit_grace)
    await server.set_serving(False)
    await asyncio.sleep(exit_grace)
    server.request_termination()


async def serve(worker: GrpcWorkerClient, scheduler_config: SchedulerConfig, serving: ServingConfig,
                metrics: ServiceMetrics, model_name: str | None = None,
                security: RpcSecurity = RpcSecurity(), exit_grace: float = 1.0) -> bool:
    """Serve until SIGTERM/SIGINT (True) or until the engine dies (False). The worker's client
    deadlines bound the wait for it to come up. vLLM's metrics are labelled `model_name` (default:
    the worker's model id)."""
    engine = await AsyncEngine.create(worker, scheduler_config, lambda core: EngineMetrics.for_core(
        metrics.registry, EngineLabels(model_name or core.model_id), core), worker.liveness_interval)
    server = RpcServer(serving.host, serving.port, [SERVICE_NAME], [metrics.grpc.server_interceptor()], security)
    engine_pb2_grpc.add_EngineServicer_to_server(EngineServicer(engine), server.server)
    await server.start()
    health = asyncio.create_task(follow_engine_health(engine, server, exit_grace))
    await server.wait_for_termination_signal()
    health.cancel()
    healthy = await engine.is_healthy()
    await server.shutdown(serving.grace if healthy else 0.0, serving.drain if healthy else 0.0)
    await engine.shutdown()
    return healthy


async def discover_worker(service: str, hostname: str, namespace: str | None) -> str:
    """The address of `service`'s ready endpoint named `hostname`, once there is one. The watch ends
    there: a worker that fails later fails the engine's steps and turns it unhealthy (no re-attachment)."""
    watcher = EndpointWatcher(service, kube_configuration(), namespace)
    watcher.start()
    logger.info("waiting for worker %s in service %s/%s", hostname, watcher.namespace, service)
    try:
        endpoint = await watcher.wait_for(lambda ready: next((e for e in ready if e.hostname == hostname), None))
    finally:
        await watcher.close()
    logger.info("worker %s is at %s", hostname, endpoint.address)
    return endpoint.address


def paired_worker_hostname(engine_hostname: str) -> str | None:
    """StatefulSet pods `<release>-engine-N` pair with `<release>-worker-N`; None for other names."""
    return engine_hostname.replace("-engine-", "-worker-") if "-engine-" in engine_hostname else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh engine", description="The kvmesh engine service.")
    add_flags(parser, EngineServiceConfig, ENV_PREFIX)
    add_flags(parser, PrefixIndexConfig, ENV_PREFIX)
    add_flags(parser, SchedulerConfig, ENV_PREFIX)
    add_flags(parser, ModelConfig, ENV_PREFIX, only=["served_model_name"])
    add_flags(parser, ServingConfig, ENV_PREFIX, defaults={"port": DEFAULT_PORT, "metrics_port": DEFAULT_METRICS_PORT})
    add_flags(parser, SecurityConfig, ENV_PREFIX)
    return parser


class EngineServiceArgs(NamedTuple):
    service: EngineServiceConfig
    scheduler: SchedulerConfig
    model: ModelConfig
    serving: ServingConfig
    security: SecurityConfig = SecurityConfig()


def parse_args(argv: list[str] | None = None) -> EngineServiceArgs:
    """The engine's configs; the worker's address defaulted or, with --worker-service, the paired
    worker's hostname found."""
    parser = build_parser()
    args = parser.parse_args(argv)
    service = build(parser, EngineServiceConfig, args)
    if service.worker_service is None and service.worker_address is None:
        service = replace(service, worker_address=DEFAULT_WORKER_ADDRESS)
    elif service.worker_service is not None and service.worker_hostname is None:
        hostname = paired_worker_hostname(socket.gethostname())
        if hostname is None:
            parser.error(f"--worker-hostname is needed: this host's name ({socket.gethostname()}) has no -engine-")
        service = replace(service, worker_hostname=hostname)
    return EngineServiceArgs(service, build(parser, SchedulerConfig, args), build(parser, ModelConfig, args),
                             build(parser, ServingConfig, args), build(parser, SecurityConfig, args))


def main(argv: list[str] | None = None) -> int:
    service, scheduler_config, model_config, serving, security_config = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine: %(message)s")
    security = RpcSecurity.load(security_config)  # the engine's own port and its calls to the worker

    async def run() -> None:
        address = service.worker_address or await discover_worker(service.worker_service, service.worker_hostname,
                                                                  service.namespace)
        metrics = ServiceMetrics.create("engine")
        endpoint = MetricsEndpoint.start(metrics.registry, serving.host, serving.metrics_port)
        # No client interceptor on the step channel: it is the hottest call there is, timed by
        # kvmesh_engine_step_rpc_seconds, and the worker's server side counts its calls by code.
        worker = GrpcWorkerClient(address, timeout=service.worker_timeout,
                                  liveness_interval=service.worker_liveness_interval,
                                  liveness_timeout=service.worker_liveness_timeout, security=security)
        try:
            return await serve(worker, scheduler_config, serving, metrics, model_config.served_model_name,
                               security, service.exit_grace)
        finally:
            if endpoint is not None:
                endpoint.close()
            worker.close()

    if not asyncio.run(run()):
        logger.error("exiting: the engine's worker failed (restart the engine with its worker)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
