"""The engine service: scheduler, KV-cache manager and prefix cache driving a worker over gRPC.

    python -m services.engine.server --worker-address 127.0.0.1:50053 --port 50052

config -> GrpcWorkerClient (blocking; the engine-loop thread calls it) -> AsyncEngine ->
EngineServicer -> grpc.aio server (+ health, reflection) -> SIGTERM -> NOT_SERVING -> drain ->
stop(grace) -> engine shutdown. Health follows the engine: NOT_SERVING as soon as its worker fails. Every flag falls back to
KVMESH_ENGINE_<FLAG> (KVMESH_ENGINE_PORT, KVMESH_ENGINE_WORKER_ADDRESS, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import grpc

from services.common.clients import EngineClient
from services.common.config import DEFAULT_MAX_NUM_WAITING, POLICIES, CacheConfig, SchedulerConfig
from services.common.errors import EngineOverloadedError
from services.common.rpc import convert
from services.common.rpc.kvmesh.v1 import engine_pb2, engine_pb2_grpc
from services.common.rpc.server import RpcServer, ServingConfig, flag_default, service_name
from services.engine.async_engine import AsyncEngine, EngineDeadError
from services.worker.client import GrpcWorkerClient

logger = logging.getLogger(__name__)

DEFAULT_PORT = 50052
SERVICE_NAME = service_name(engine_pb2.DESCRIPTOR, "Engine")


class EngineServicer(engine_pb2_grpc.EngineServicer):
    """Converts proto <-> core and calls the engine; maps its errors to status codes:
    ValueError -> INVALID_ARGUMENT, EngineOverloadedError -> RESOURCE_EXHAUSTED, EngineDeadError -> UNAVAILABLE."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    async def Generate(self, request: engine_pb2.EngineRequest, context):
        try:
            core_request = convert.engine_request_from_proto(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # A cancelled call (the caller went away) cancels this coroutine at an await; closing the
        # stream then aborts the request in the engine.
        stream = self.engine.generate(core_request)
        try:
            async for output in stream:
                yield convert.engine_output_to_proto(output)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineOverloadedError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:
            await stream.aclose()

    async def Abort(self, request: engine_pb2.AbortRequest, context) -> engine_pb2.AbortResponse:
        await self.engine.abort(list(request.request_ids))
        return engine_pb2.AbortResponse()

    async def GetStats(self, request: engine_pb2.GetStatsRequest, context) -> engine_pb2.EngineStats:
        return convert.engine_stats_to_proto(await self.engine.stats())

    async def GetInfo(self, request: engine_pb2.GetEngineInfoRequest, context) -> engine_pb2.EngineInfo:
        return convert.engine_info_to_proto(await self.engine.info())


async def _follow_health(engine: AsyncEngine, server: RpcServer) -> None:
    """Turn the health service NOT_SERVING once the engine is unhealthy (it does not recover)."""
    await engine.wait_until_unhealthy()
    logger.error("engine unhealthy: health is NOT_SERVING")
    await server.set_serving(False)


async def serve(worker: GrpcWorkerClient, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                serving: ServingConfig) -> None:
    """Serve until SIGTERM/SIGINT. The worker's client deadlines bound the wait for it to come up."""
    engine = await AsyncEngine.create(worker, cache_config, scheduler_config)
    server = RpcServer(serving.host, serving.port, [SERVICE_NAME])
    engine_pb2_grpc.add_EngineServicer_to_server(EngineServicer(engine), server.server)
    await server.start()
    health = asyncio.create_task(_follow_health(engine, server))
    await server.wait_for_termination_signal()
    health.cancel()
    await server.shutdown(serving.grace, serving.drain)
    await engine.shutdown()


def build_parser() -> argparse.ArgumentParser:
    def flag(name: str, default: object) -> object:
        return flag_default("KVMESH_ENGINE", name, default)

    parser = argparse.ArgumentParser(prog="kvmesh engine", description="The kvmesh engine service.")
    parser.add_argument("--worker-address", default=flag("worker_address", "127.0.0.1:50053"))
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
    return parser


def _bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("1", "true", "yes", "on"):
        return True
    if str(value).lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine: %(message)s")
    cache_config = CacheConfig(block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching)
    scheduler_config = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                       max_num_seqs=args.max_num_seqs, policy=args.scheduling_policy,
                                       max_num_waiting=args.max_num_waiting)
    serving = ServingConfig(args.host, args.port, args.grace, args.drain)

    async def run() -> None:
        worker = GrpcWorkerClient(args.worker_address, timeout=args.worker_timeout, step_timeout=args.worker_timeout)
        try:
            await serve(worker, cache_config, scheduler_config, serving)
        finally:
            worker.close()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
