"""AsyncEngine: the in-process EngineClient. An EngineCore driven by an asyncio task that awaits
its worker (a WorkerClient: in this process or over gRPC) once per step.

    loop task:  apply aborts -> schedule() -> await worker.execute_model() -> update_from_output()
                -> each output to its request's queue
    generate(): add the request, then yield from its queue; closing early (the caller was
                cancelled, or stopped reading) aborts the request before the next step.

Aborts made while a step is in flight wait for the step to end (the scheduler's running set is
only changed between steps); new requests join the waiting queue at once, which a step in flight
never reads. A failed step (the worker died, or answered an error) is fatal: every
open stream raises EngineDeadError, the engine reports unhealthy and refuses new requests, and a
supervisor restarts it (its worker's state is gone or suspect; recovering it is not a local decision).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable, Sequence

from services.common.clients import EngineInfo, EngineStats, WorkerClient
from services.common.config import CacheConfig, SchedulerConfig
from services.common.engine_output import EngineCoreOutput, EngineCoreRequest
from services.engine.engine_core import EngineCore

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine has stopped serving (its worker failed, or it shut down)."""


class AsyncEngine:
    def __init__(self, core: EngineCore, worker: WorkerClient, info: EngineInfo) -> None:
        self.core = core
        self.worker = worker
        self._info = info
        self._queues: dict[str, asyncio.Queue[EngineCoreOutput | BaseException]] = {}
        self._pending_aborts: set[str] = set()
        self._has_work = asyncio.Event()
        self._error: EngineDeadError | None = None
        self._dead = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None

    @classmethod
    async def create(cls, worker: WorkerClient, cache_config: CacheConfig,
                     scheduler_config: SchedulerConfig) -> AsyncEngine:
        """Ask the worker for its model and KV-cache size, build the core, start the loop."""
        worker_info = await worker.get_info()
        if worker_info.block_size != cache_config.block_size:
            raise ValueError(f"the engine's block size {cache_config.block_size} differs from its worker's "
                             f"{worker_info.block_size}; start both with the same --block-size")
        num_blocks = await worker.initialize_cache(scheduler_config.max_num_seqs)
        core = EngineCore(None, num_blocks, worker_info.max_model_len, worker_info.model_id,
                          cache_config, scheduler_config)
        info = EngineInfo(worker_info.model_id, worker_info.model_path, core.max_model_len, core.block_size)
        engine = cls(core, worker, info)
        engine.start()
        return engine

    def start(self) -> None:
        assert self._loop_task is None, "already started"
        self._loop_task = asyncio.create_task(self._run(), name="engine-loop")

    async def shutdown(self) -> None:
        """Stop the loop; streams still open end with EngineDeadError."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        self._fail(EngineDeadError("the engine is shutting down"))

    # ------------------------------------------------------------------ EngineClient

    async def info(self) -> EngineInfo:
        return self._info

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        if self._error is not None:
            raise self._error
        if request.request_id in self._queues:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.core.add_request(request)  # validates: ValueError for the caller
        queue: asyncio.Queue[EngineCoreOutput | BaseException] = asyncio.Queue()
        self._queues[request.request_id] = queue
        self._has_work.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # nothing left to abort: the engine is dead
                    raise item
                finished = item.finished
                yield item
        finally:
            del self._queues[request.request_id]
            if not finished:
                self._abort_soon([request.request_id])

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Idempotent; each open stream of these ids ends with finish_reason "abort"."""
        self._abort_soon(request_ids)

    async def stats(self) -> EngineStats:
        return self.core.stats()

    async def is_healthy(self) -> bool:
        return self._error is None

    async def wait_until_unhealthy(self) -> None:
        await self._dead.wait()

    # ------------------------------------------------------------------ the loop

    def _abort_soon(self, request_ids: Iterable[str]) -> None:
        if self._error is None:
            self._pending_aborts.update(request_ids)
            self._has_work.set()

    def _apply_aborts(self) -> None:
        request_ids, self._pending_aborts = self._pending_aborts, set()
        self.core.abort_requests(request_ids)
        for request_id in request_ids:
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(EngineCoreOutput(request_id, [], finish_reason="abort"))

    def _has_pending_work(self) -> bool:
        # Finished ids alone still need a step: the worker must drop their state.
        return bool(self._pending_aborts or self.core.has_unfinished_requests()
                    or self.core.scheduler.finished_req_ids)

    async def _run(self) -> None:
        try:
            while True:
                if not self._has_pending_work():
                    self._has_work.clear()
                    await self._has_work.wait()
                    continue
                self._apply_aborts()
                await self._step()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the worker died or failed a step: fatal, see the module docstring
            logger.exception("engine step failed")
            self._fail(EngineDeadError(f"engine step failed: {_describe(exc)}"))

    async def _step(self) -> None:
        scheduler_output = self.core.schedule()
        if scheduler_output.is_empty and not scheduler_output.finished_req_ids:
            # Nothing could be scheduled this time (cannot last: running requests free their
            # blocks as they finish); yield so the event loop is not starved.
            await asyncio.sleep(0.001)
            return
        runner_output = await self.worker.execute_model(scheduler_output)
        for output in self.core.update_from_output(scheduler_output, runner_output):
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)

    def _fail(self, error: EngineDeadError) -> None:
        if self._error is None:
            self._error = error
            self._dead.set()
        self._pending_aborts.clear()
        self.core.abort_requests(list(self.core.scheduler.requests))
        for queue in self._queues.values():
            queue.put_nowait(self._error)


def _describe(exc: BaseException) -> str:
    """One line for an error, with a gRPC status and details when it is an RPC error."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if callable(code) and callable(details):
        return f"{code().name}: {details()}"
    return f"{type(exc).__name__}: {exc}"
