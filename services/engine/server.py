"""The engine service: scheduler, KV-cache manager and prefix cache driving a worker over gRPC.

    python -m services.engine.server --worker-address 127.0.0.1:50053 --port 50052
    python -m services.engine.server --worker-service kvmesh-worker    # in Kubernetes: pod kvmesh-engine-N
                                                                       # pairs with kvmesh-worker-N

config -> GrpcWorkerClient (blocking; the engine-loop thread calls it) -> AsyncEngine ->
EngineServicer -> grpc.aio server (+ health, reflection) -> SIGTERM -> NOT_SERVING -> drain ->
stop(grace) -> engine shutdown. Health follows the engine: NOT_SERVING as soon as its worker fails. Every flag falls back to
KVMESH_ENGINE_<FLAG> (KVMESH_ENGINE_PORT, KVMESH_ENGINE_WORKER_ADDRESS, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
from contextlib import aclosing

from services.common.clients import EngineClient
from services.common.config import DEFAULT_MAX_NUM_WAITING, POLICIES, CacheConfig, SchedulerConfig
from services.common.discovery import EndpointWatcher, kube_configuration
from services.common.errors import answers_with_status
from services.common.metrics import MetricsEndpoint, ServiceMetrics
from services.common.rpc import convert
from services.common.rpc.kvmesh.v1 import engine_pb2, engine_pb2_grpc
from services.common.rpc.server import RpcServer, ServingConfig, flag_default, service_name
from services.engine.async_engine import AsyncEngine
from services.engine.metrics import EngineLabels, EngineMetrics
from services.worker.client import GrpcWorkerClient

logger = logging.getLogger(__name__)

DEFAULT_PORT = 50052
DEFAULT_METRICS_PORT = 9052
DEFAULT_WORKER_ADDRESS = "127.0.0.1:50053"
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


async def follow_engine_health(engine: AsyncEngine, server: RpcServer) -> None:
    """Turn the health service NOT_SERVING once the engine is unhealthy (it does not recover)."""
    await engine.wait_until_unhealthy()
    logger.error("engine unhealthy: health is NOT_SERVING")
    await server.set_serving(False)


async def serve(worker: GrpcWorkerClient, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                serving: ServingConfig, metrics: ServiceMetrics, model_name: str | None = None) -> None:
    """Serve until SIGTERM/SIGINT. The worker's client deadlines bound the wait for it to come up.
    vLLM's metrics are labelled `model_name` (default: the worker's model id)."""
    engine = await AsyncEngine.create(worker, cache_config, scheduler_config, lambda core: EngineMetrics.for_core(
        metrics.registry, EngineLabels(model_name or core.model_id), core))
    server = RpcServer(serving.host, serving.port, [SERVICE_NAME], [metrics.grpc.server_interceptor()])
    engine_pb2_grpc.add_EngineServicer_to_server(EngineServicer(engine), server.server)
    await server.start()
    health = asyncio.create_task(follow_engine_health(engine, server))
    await server.wait_for_termination_signal()
    health.cancel()
    await server.shutdown(serving.grace, serving.drain)
    await engine.shutdown()


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
    def flag(name: str, default: object) -> object:
        return flag_default("KVMESH_ENGINE", name, default)

    parser = argparse.ArgumentParser(prog="kvmesh engine", description="The kvmesh engine service.")
    parser.add_argument("--worker-address", default=flag("worker_address", None),
                        help=f"the worker, off Kubernetes (default {DEFAULT_WORKER_ADDRESS})")
    parser.add_argument("--worker-service", default=flag("worker_service", None),
                        help="the workers' Kubernetes Service: connect to its ready endpoint (port named grpc) "
                             "whose hostname is --worker-hostname; excludes --worker-address")
    parser.add_argument("--worker-hostname", default=flag("worker_hostname", None),
                        help="with --worker-service (default: this host's name with -engine- replaced by -worker-)")
    parser.add_argument("--namespace", default=flag("namespace", None),
                        help="the Service's namespace (default: this pod's, else $KVMESH_NAMESPACE, else default)")
    parser.add_argument("--host", default=flag("host", "127.0.0.1"), help="interface to listen on")
    parser.add_argument("--port", type=int, default=flag("port", DEFAULT_PORT))
    parser.add_argument("--max-num-batched-tokens", type=int, default=flag("max_num_batched_tokens", 2048))
    parser.add_argument("--max-num-seqs", type=int, default=flag("max_num_seqs", 128))
    parser.add_argument("--max-num-waiting", type=int, default=flag("max_num_waiting", DEFAULT_MAX_NUM_WAITING),
                        help="requests held beyond the --max-num-seqs running ones; more are refused "
                             "(RESOURCE_EXHAUSTED), never queued without bound")
    parser.add_argument("--scheduling-policy", default=flag("scheduling_policy", "fcfs"), choices=POLICIES)
    parser.add_argument("--block-size", type=int, default=flag("block_size", 16),
                        help="must equal the worker's --block-size")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=_bool(flag("enable_prefix_caching", "true")))
    parser.add_argument("--worker-timeout", type=float, default=flag("worker_timeout", 60.0),
                        help="deadline (s) of each worker call, and for the worker to come up")
    parser.add_argument("--grace", type=float, default=flag("grace", 5.0), help="seconds for in-flight streams at shutdown")
    parser.add_argument("--drain", type=float, default=flag("drain", 0.0),
                        help="seconds between NOT_SERVING and refusing new calls at shutdown")
    parser.add_argument("--metrics-port", type=int, default=flag("metrics_port", DEFAULT_METRICS_PORT),
                        help="port of /metrics on --host (0: none)")
    parser.add_argument("--served-model-name", default=flag("served_model_name", None),
                        help="the model_name label of vLLM's metrics (default: the worker's model id)")
    return parser


def _bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("1", "true", "yes", "on"):
        return True
    if str(value).lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker_service is None:
        if args.worker_hostname is not None:
            parser.error("--worker-hostname needs --worker-service")
        args.worker_address = args.worker_address or DEFAULT_WORKER_ADDRESS
        return args
    if args.worker_address is not None:
        parser.error("--worker-address and --worker-service exclude each other")
    if args.worker_hostname is None:
        args.worker_hostname = paired_worker_hostname(socket.gethostname())
        if args.worker_hostname is None:
            parser.error(f"--worker-hostname is needed: this host's name ({socket.gethostname()}) has no -engine-")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine: %(message)s")
    cache_config = CacheConfig(block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching)
    scheduler_config = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                       max_num_seqs=args.max_num_seqs, policy=args.scheduling_policy,
                                       max_num_waiting=args.max_num_waiting)
    serving = ServingConfig(args.host, args.port, args.grace, args.drain)

    async def run() -> None:
        address = args.worker_address or await discover_worker(args.worker_service, args.worker_hostname,
                                                               args.namespace)
        metrics = ServiceMetrics.create("engine")
        endpoint = MetricsEndpoint.start(metrics.registry, args.host, args.metrics_port)
        # No client interceptor on the step channel: it is the hottest call there is, timed by
        # kvmesh_engine_step_rpc_seconds, and the worker's server side counts its calls by code.
        worker = GrpcWorkerClient(address, timeout=args.worker_timeout, step_timeout=args.worker_timeout)
        try:
            await serve(worker, cache_config, scheduler_config, serving, metrics, args.served_model_name)
        finally:
            if endpoint is not None:
                endpoint.close()
            worker.close()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
