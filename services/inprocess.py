"""The in-process stack, composed in this one place: the worker core, the engine over it and the
processor over that, joined by direct calls where `kvmesh serve` joins the same cores by gRPC.

    OfflineStack.create(args)        worker -> EngineCore (stepped by its caller) -> Processor
                                     the offline `LLM`, which drives it step by step; with
                                     tensor_parallel_size above 1 the workers are processes
                                     (services/engine/worker_processes.py), the rest in-process
    await AsyncStack.create(args)    worker -> AsyncEngine (its engine-loop thread) -> AsyncProcessor
                                     a ProcessorClient: the gateway app in one process
                                     (loadtests/inprocess_server.py, the gateway stack tests)
"""

from __future__ import annotations

from typing import NamedTuple

from services.common.config import EngineArgs
from services.engine.async_engine import AsyncEngine
from services.engine.engine_core import EngineCore
from services.engine.worker_processes import WorkerProcesses
from services.processor.async_processor import AsyncProcessor
from services.processor.processor import Processor
from services.worker.client import InProcessWorkerClient
from services.worker.worker import Worker


def start_worker(args: EngineArgs) -> InProcessWorkerClient:
    """The worker core (weights loaded; its KV cache is allocated by the engine's first call)."""
    return InProcessWorkerClient(Worker(args.model, args.cache, args.worker, lora=args.lora), args.worker.max_num_seqs)


class OfflineStack(NamedTuple):
    worker: Worker | None  # None with worker processes
    engine: EngineCore
    processor: Processor
    worker_processes: WorkerProcesses | None = None  # close() them when done

    @classmethod
    def create(cls, args: EngineArgs) -> OfflineStack:
        if args.parallel.tensor_parallel_size == 1:
            worker = start_worker(args)
            engine = EngineCore.create(worker, args.scheduler, executor=worker, lora=args.lora)
            return cls(worker.worker, engine, Processor.load(worker.worker.model_path, engine.max_model_len,
                                                             args.model.chat_template))
        processes = WorkerProcesses.start(args.model, args.cache, args.worker, args.parallel, lora=args.lora)
        try:
            engine = EngineCore.create(processes.client, args.scheduler, executor=processes.client, lora=args.lora)
            processor = Processor.load(engine.worker_info.model_path, engine.max_model_len, args.model.chat_template)
        except BaseException:
            processes.close()
            raise
        return cls(None, engine, processor, processes)


class AsyncStack(NamedTuple):
    worker: Worker
    engine: AsyncEngine
    processor: AsyncProcessor

    @classmethod
    async def create(cls, args: EngineArgs) -> AsyncStack:
        """Call `shutdown()` when done: the engine-loop thread runs until then."""
        worker = start_worker(args)
        engine = await AsyncEngine.create(worker, args.scheduler, lora=args.lora)
        processor = Processor.load(worker.worker.model_path, engine.core.max_model_len, args.model.chat_template)
        return cls(worker.worker, engine, AsyncProcessor(processor, engine))

    async def shutdown(self) -> None:
        self.processor.close()
        await self.engine.shutdown()
