"""WorkerClient implementations: the worker core in this process, or a worker server over gRPC."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc

from services.common.clients import WorkerInfo
from services.common.model_runner_output import ModelRunnerOutput
from services.common.rpc import convert
from services.common.rpc.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.common.rpc.server import GRPC_OPTIONS
from services.common.scheduler_output import SchedulerOutput

if TYPE_CHECKING:  # the gRPC client (the engine's side) must not pull in torch
    from services.worker.worker import Worker


class InProcessWorkerClient:
    """The worker core on this process's event loop: its synchronous torch work runs on one
    dedicated thread (always the same one, so steps never overlap and the thread stays warm) while
    the loop keeps serving health and other calls. `max_num_reqs` caps the persistent batch an
    engine may ask for (None: no cap)."""

    def __init__(self, worker: Worker, max_num_reqs: int | None = None) -> None:
        self.worker = worker
        self.max_num_reqs = max_num_reqs
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker-step")

    async def get_info(self) -> WorkerInfo:
        return WorkerInfo(*self.worker.info)

    async def initialize_cache(self, max_num_reqs: int) -> int:
        if max_num_reqs < 1:
            raise ValueError(f"max_num_reqs must be positive, got {max_num_reqs}")
        if self.max_num_reqs is not None and max_num_reqs > self.max_num_reqs:
            raise ValueError(f"max_num_reqs {max_num_reqs} exceeds this worker's limit of {self.max_num_reqs}")
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._initialize_cache, max_num_reqs)

    def _initialize_cache(self, max_num_reqs: int) -> int:
        num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_cache(num_blocks, max_num_reqs)
        return num_blocks

    async def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.worker.execute_model,
                                                                scheduler_output)


class GrpcWorkerClient:
    """A worker server over gRPC. Every call has a deadline: `timeout` for the set-up calls (which
    also wait for the worker to come up), `step_timeout` for each ExecuteModel (a long prefill on a
    CPU takes seconds). A lost worker fails the call at once with UNAVAILABLE (no waiting for
    ready), so the engine notices within one step. Construct inside the running event loop."""

    def __init__(self, address: str, timeout: float = 60.0, step_timeout: float = 60.0) -> None:
        self.address = address
        self.timeout = timeout
        self.step_timeout = step_timeout
        self._channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)

    async def get_info(self) -> WorkerInfo:
        reply = await self._stub.GetInfo(worker_pb2.GetWorkerInfoRequest(), timeout=self.timeout,
                                         wait_for_ready=True)
        return convert.worker_info_from_proto(reply)

    async def initialize_cache(self, max_num_reqs: int) -> int:
        reply = await self._stub.InitializeCache(worker_pb2.InitializeCacheRequest(max_num_reqs=max_num_reqs),
                                                 timeout=self.timeout, wait_for_ready=True)
        return reply.num_blocks

    async def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        reply = await self._stub.ExecuteModel(convert.scheduler_output_to_proto(scheduler_output),
                                              timeout=self.step_timeout)
        return convert.model_runner_output_from_proto(reply)

    async def close(self) -> None:
        await self._channel.close()
