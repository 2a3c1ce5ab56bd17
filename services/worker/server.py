"""The worker service: one device's model, KV cache and persistent batch behind gRPC.

    python -m services.worker.server --model smollm2 --port 50053 --kv-cache-memory 268435456

config -> Worker core -> WorkerServicer -> grpc.aio server (+ health, reflection) -> SIGTERM ->
NOT_SERVING -> stop(grace). Flags come from services/common/config.py (ModelConfig, CacheConfig,
WorkerConfig, ServingConfig); each falls back to KVMESH_WORKER_<FIELD> (KVMESH_WORKER_PORT, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from services.common.clients import WorkerClient
from services.common.config import CacheConfig, ModelConfig, ServingConfig, WorkerConfig
from services.common.errors import answers_with_status
from services.common.flags import add_flags, build
from services.common.rpc import convert
from services.common.rpc.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.common.metrics import MetricsEndpoint, ServiceMetrics
from services.common.model_runner_output import ModelRunnerOutput
from services.common.rpc.server import RpcServer, service_name
from services.common.scheduler_output import SchedulerOutput
from services.worker.client import InProcessWorkerClient
from services.worker.metrics import WorkerMetrics
from services.worker.worker import Worker

DEFAULT_PORT = 50053
DEFAULT_METRICS_PORT = 9053
ENV_PREFIX = "KVMESH_WORKER"  # KVMESH_WORKER_PORT for --port, ...
T = TypeVar("T")
INLINE_STEP_TOKENS = 256  # see WorkerServicer
SERVICE_NAME = service_name(worker_pb2.DESCRIPTOR, "Worker")


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Converts proto <-> core and calls the in-process worker client. Decode steps (one token per
    request, at most INLINE_STEP_TOKENS in all) run on the event loop itself: the hop to another
    thread and back costs ~0.2 ms, a sixth of the whole step RPC on loopback, and such a step is
    short. Steps with a prefill chunk (and cache set-up) run on one dedicated thread, so that
    health checks — the engine's liveness checks during a step — are answered while a chunk is
    computed, however long it takes. Steps never overlap either way: the engine sends one at a time."""

    def __init__(self, worker: WorkerClient, metrics: WorkerMetrics | None = None) -> None:
        self.worker = worker
        self.metrics = metrics
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker-step")

    async def _call(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    @answers_with_status
    async def GetInfo(self, request: worker_pb2.GetWorkerInfoRequest, context) -> worker_pb2.WorkerInfo:
        return convert.worker_info_to_proto(self.worker.get_info())

    @answers_with_status
    async def InitializeCache(self, request: worker_pb2.InitializeCacheRequest,
                              context) -> worker_pb2.InitializeCacheResponse:
        num_blocks = await self._call(self.worker.initialize_cache, request.max_num_reqs)
        return worker_pb2.InitializeCacheResponse(num_blocks=num_blocks)

    @answers_with_status
    async def ExecuteModel(self, request: worker_pb2.SchedulerOutput, context) -> worker_pb2.ModelRunnerOutput:
        # A failed step is logged with its traceback (status_of); the engine gets INTERNAL.
        scheduler_output = convert.scheduler_output_from_proto(request)
        num_tokens = scheduler_output.total_num_scheduled_tokens
        if num_tokens <= INLINE_STEP_TOKENS and num_tokens == len(scheduler_output.num_scheduled_tokens):
            runner_output = self._execute_model(scheduler_output)
        else:
            runner_output = await self._call(self._execute_model, scheduler_output)
        return convert.model_runner_output_to_proto(runner_output)

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The step, timed where it runs (no hand-off between threads counted)."""
        start = time.perf_counter()
        runner_output = self.worker.execute_model(scheduler_output)
        if self.metrics is not None:
            self.metrics.observe_step(time.perf_counter() - start)
        return runner_output


async def serve(worker: WorkerClient, serving: ServingConfig, metrics: WorkerMetrics | None = None) -> None:
    """Serve `worker` until SIGTERM/SIGINT, then NOT_SERVING and stop(grace)."""
    interceptors = [metrics.service.grpc.server_interceptor()] if metrics is not None else []
    server = RpcServer(serving.host, serving.port, [SERVICE_NAME], interceptors)
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(worker, metrics), server.server)
    await server.start()
    await server.wait_for_termination_signal()
    await server.shutdown(serving.grace, serving.drain)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh worker", description="The kvmesh worker service.")
    for config_class in (ModelConfig, CacheConfig, WorkerConfig):
        add_flags(parser, config_class, ENV_PREFIX)
    add_flags(parser, ServingConfig, ENV_PREFIX, defaults={"port": DEFAULT_PORT, "metrics_port": DEFAULT_METRICS_PORT})
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    model_config, cache_config, worker_config, serving = (
        build(parser, c, args) for c in (ModelConfig, CacheConfig, WorkerConfig, ServingConfig))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s worker: %(message)s")
    worker = Worker(model_config, cache_config, worker_config)
    metrics = WorkerMetrics(ServiceMetrics.create("worker"), model_config.served_model_name or worker.info.model_id)
    metrics.watch_forward(worker.model, worker.device)
    endpoint = MetricsEndpoint.start(metrics.service.registry, serving.host, serving.metrics_port)
    try:
        asyncio.run(serve(InProcessWorkerClient(worker, worker_config.max_num_seqs), serving, metrics))
    finally:
        if endpoint is not None:
            endpoint.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
