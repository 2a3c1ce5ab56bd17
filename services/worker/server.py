"""The worker service: one device's model, KV cache and persistent batch behind gRPC.

    python -m services.worker.server --model smollm2 --port 50053 --kv-cache-memory 268435456

config -> Worker core -> WorkerServicer -> grpc.aio server (+ health, reflection) -> SIGTERM ->
NOT_SERVING -> stop(grace). Every flag falls back to KVMESH_WORKER_<FLAG> (KVMESH_WORKER_PORT, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from services.common.clients import WorkerClient
from services.common.config import ATTENTION_BACKENDS, DTYPES, CacheConfig, ModelConfig, WorkerConfig
from services.common.errors import answers_with_status
from services.common.rpc import convert
from services.common.rpc.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.common.metrics import MetricsEndpoint, ServiceMetrics
from services.common.model_runner_output import ModelRunnerOutput
from services.common.rpc.server import RpcServer, ServingConfig, flag_default, service_name
from services.common.scheduler_output import SchedulerOutput
from services.worker.client import InProcessWorkerClient
from services.worker.metrics import WorkerMetrics
from services.worker.worker import Worker

DEFAULT_PORT = 50053
DEFAULT_METRICS_PORT = 9053
T = TypeVar("T")
INLINE_STEP_TOKENS = 256  # see WorkerServicer
SERVICE_NAME = service_name(worker_pb2.DESCRIPTOR, "Worker")


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Converts proto <-> core and calls the in-process worker client. Decode-sized steps (at most
    INLINE_STEP_TOKENS tokens) run on the event loop itself: the hop to another thread and back
    costs ~0.2 ms, a sixth of the whole step RPC on loopback, and such a step is short. Larger ones
    (and cache set-up) run on one dedicated thread, so that health checks are still answered
    during a long prefill. Steps never overlap either way: the engine sends one at a time."""

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
        if scheduler_output.total_num_scheduled_tokens <= INLINE_STEP_TOKENS:
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
    def flag(name: str, default: object) -> object:
        return flag_default("KVMESH_WORKER", name, default)

    parser = argparse.ArgumentParser(prog="kvmesh worker", description="The kvmesh worker service.")
    parser.add_argument("--model", default=flag("model", "smollm2"), help="model name, path or GGUF file")
    parser.add_argument("--dtype", default=flag("dtype", "float32"), choices=DTYPES)
    parser.add_argument("--device", default=flag("device", "cpu"), help="torch device (cpu, cuda, cuda:1)")
    parser.add_argument("--max-model-len", type=int, default=flag("max_model_len", None))
    parser.add_argument("--seed", type=int, default=flag("seed", 0))
    parser.add_argument("--cache-dir", type=Path, default=flag("cache_dir", None))
    parser.add_argument("--host", default=flag("host", "127.0.0.1"), help="interface to listen on")
    parser.add_argument("--port", type=int, default=flag("port", DEFAULT_PORT))
    parser.add_argument("--block-size", type=int, default=flag("block_size", 16))
    parser.add_argument("--kv-cache-memory", type=int, default=flag("kv_cache_memory", None),
                        help="KV cache bytes (default: a fraction of free memory)")
    parser.add_argument("--attention-backend", default=flag("attention_backend", "auto"), choices=ATTENTION_BACKENDS)
    parser.add_argument("--max-num-seqs", type=int, default=flag("max_num_seqs", 1024),
                        help="the largest batch an engine may ask this worker for")
    parser.add_argument("--grace", type=float, default=flag("grace", 5.0), help="seconds for in-flight calls at shutdown")
    parser.add_argument("--metrics-port", type=int, default=flag("metrics_port", DEFAULT_METRICS_PORT),
                        help="port of /metrics on --host (0: none)")
    parser.add_argument("--served-model-name", default=flag("served_model_name", None),
                        help="the model_name label of this worker's metrics (default: the model's id)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s worker: %(message)s")
    model_config = ModelConfig(model=args.model, dtype=args.dtype, device=args.device,
                               max_model_len=args.max_model_len, cache_dir=args.cache_dir, seed=args.seed)
    cache_config = CacheConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory)
    worker = Worker(model_config, cache_config, WorkerConfig(attention_backend=args.attention_backend))
    serving = ServingConfig(args.host, args.port, args.grace)
    metrics = WorkerMetrics(ServiceMetrics.create("worker"), args.served_model_name or worker.info.model_id)
    metrics.watch_forward(worker.model, worker.device)
    endpoint = MetricsEndpoint.start(metrics.service.registry, args.host, args.metrics_port)
    try:
        asyncio.run(serve(InProcessWorkerClient(worker, args.max_num_seqs), serving, metrics))
    finally:
        if endpoint is not None:
            endpoint.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
