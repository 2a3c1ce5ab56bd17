"""AsyncEngine: the in-process EngineClient. An EngineCore driven by its engine-loop thread, which
calls its worker (a blocking WorkerClient: in this process or over gRPC) once per step; the asyncio
side only queues work for it and hands its outputs to the streams.

    engine-loop thread: take the inbox (new requests, aborts) -> schedule() -> worker.execute_model()
                        -> update_from_output() -> the step's outputs to the event loop in one call
    event loop:         generate() checks the request, puts it in the inbox, then yields from its
                        queue; closing early (the caller was cancelled, or stopped reading) puts an
                        abort in the inbox, applied before the next step.

Between steps the engine-loop thread also serves the prefix-index publisher's requests for a cache
snapshot (request_cache_snapshot; services/engine/kv_publisher.py): recorded into the core's KV event
queue there, it is ordered against every cache change.

Why a thread: the step RPC is on the critical path of every token, and a blocking gRPC call from a
plain thread is ~0.3 ms cheaper per round trip than awaiting it on the event loop (and the loop
stays free for the streams). Only the engine-loop thread changes the core's state while it runs;
the event loop reads its counters (`stats()`), which the GIL keeps whole. New requests are admitted
in arrival order at the start of a step, so `add_request`'s checks that depend on the queue (the
waiting-queue limit) see every earlier request already queued; a refusal there reaches the caller
as the exception its stream raises first.

Failures. A request the worker refuses for its own data (ModelRunnerOutput.failed) ends alone: its
stream raises ValueError, the step goes on for the others. A failed step (the worker is gone, stuck
— its client checks its liveness while a step runs, see services/worker/client.py — or answered an
error) is fatal: every open stream raises EngineDeadError, the engine reports unhealthy and refuses
new requests, and the engine service exits so that its supervisor (kvmesh serve, Kubernetes)
restarts it with its worker (whose state is gone or suspect; recovering it is not a local
decision). While idle, the loop checks its worker every `idle_check_interval` seconds, however often
calls wake it, so a worker that died or hung between requests is noticed before the next request meets
it; the check also renews the engine's lease on its worker (services/worker/server.py), so an engine
idle for longer than the lease keeps its worker.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import replace
from typing import NamedTuple, Protocol, TypeVar

from services.common.clients import EngineInfo, EngineStats, PrefixMatch, WorkerClient
from services.common.config import GrammarLimits, LoRAConfig, SchedulerConfig
from services.common.engine_output import EngineCoreOutput, EngineCoreRequest
from services.common.errors import EngineDeadError
from services.engine.engine_core import EngineCore
from services.engine.kv_event_queue import KVEventQueue
from services.engine.metrics import EngineMetrics

logger = logging.getLogger(__name__)
T = TypeVar("T")

IDLE_SCHEDULE_WAIT = 0.001  # seconds; see _step


# What the engine-loop thread hands a stream: an output, or the exception it ends with.
Item = EngineCoreOutput | BaseException


class RemotePrefill(Protocol):
    """What this engine asks of disaggregated prefill (services/engine/disaggregation.py), which
    drives this engine: this engine only hands it requests and tells it of expired leases."""

    role: str

    def start(self, request: EngineCoreRequest) -> None: ...

    def cancel(self, request_id: str) -> None: ...

    def record_expired(self, count: int) -> None: ...


class EngineIdentity(NamedTuple):
    """This engine in a fleet (EngineInfo.engine_id / epoch): the address processors reach it at, and
    its start time in ns. ("", 0): not part of a fleet."""

    engine_id: str = ""
    epoch: int = 0


class AsyncEngine:
    def __init__(self, core: EngineCore, worker: WorkerClient, info: EngineInfo,
                 metrics: EngineMetrics | None = None, idle_check_interval: float | None = None) -> None:
        self.core = core
        self.idle_check_interval = idle_check_interval  # None: the idle loop never checks its worker
        self._next_idle_check = 0.0  # time.monotonic() of the idle loop's next worker check
        self.metrics = metrics  # fed on the engine-loop thread only
        self.worker = worker
        self._info = info
        self._queues: dict[str, asyncio.Queue[Item]] = {}  # event loop only
        self._inbox_lock = threading.Lock()
        self._new_requests: list[EngineCoreRequest] = []
        self._aborts: set[str] = set()
        self._wake = threading.Event()
        self._snapshot_wanted = threading.Event()  # see request_cache_snapshot
        # Functions to run on the engine-loop thread between steps (call_in_loop), with their futures.
        self._calls: list[tuple[Callable[[], object], asyncio.Future | None]] = []
        # Disaggregated prefill/decode: set by the engine service when its workers take part.
        self.disaggregation: RemotePrefill | None = None
        self._stopping = False
        self._error: EngineDeadError | None = None
        self._dead = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    async def create(cls, worker: WorkerClient, scheduler_config: SchedulerConfig,
                     metrics: Callable[[EngineCore], EngineMetrics] | None = None,
                     idle_check_interval: float | None = None, *, kv_events: KVEventQueue | None = None,
                     identity: EngineIdentity = EngineIdentity(),
                     grammar_limits: GrammarLimits = GrammarLimits(), model_name: str = "",
                     lora: LoRAConfig = LoRAConfig()) -> AsyncEngine:
        """Ask the worker for its model, block size and KV-cache size, build the core (and its
        metrics, which need the core's sizes), start the loop. `kv_events`: the prefix-index
        publisher's queue (services/engine/kv_publisher.py); None: the block pool records nothing.
        `model_name`: what clients call the model (default: its model id), told in its info."""
        core = await asyncio.to_thread(EngineCore.create, worker, scheduler_config, kv_events=kv_events,
                                       grammar_limits=grammar_limits, lora=lora)
        info = EngineInfo(model_id=core.model_id, model_path=core.worker_info.model_path,
                          max_model_len=core.max_model_len, block_size=core.block_size,
                          engine_id=identity.engine_id, epoch=identity.epoch,
                          model_name=model_name or core.model_id)
        engine = cls(core, worker, info, metrics(core) if metrics is not None else None, idle_check_interval)
        engine.start()
        return engine

    def start(self) -> None:
        assert self._thread is None, "already started"
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the loop (after the step in flight); streams still open end with EngineDeadError."""
        if self._thread is not None:
            self._stopping = True
            self._wake.set()
            await asyncio.to_thread(self._thread.join)
        self._fail(EngineDeadError("the engine is shutting down"))

    # ------------------------------------------------------------------ EngineClient

    async def info(self) -> EngineInfo:
        return self._info

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        if self._error is not None:
            raise self._error
        if request.request_id in self._queues:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.core.check_request(request)  # ValueError for the caller, before anything is queued
        if request.arrival_time is None:  # arrival is now, not when the engine-loop thread admits it
            request = replace(request, arrival_time=time.monotonic())
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self._queues[request.request_id] = queue
        remote = request.prefill_engine_address is not None and self.disaggregation is not None
        if remote:
            self.disaggregation.start(request)  # admits it (computed elsewhere, or here) when it can
        else:
            self.admit(request)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # refused at admission, or the engine died: nothing to abort
                    raise item
                finished = item.finished
                yield item
        finally:
            del self._queues[request.request_id]
            if not finished:
                if remote:
                    self.disaggregation.cancel(request.request_id)
                self._abort_soon([request.request_id])

    def enable_disaggregation(self, disaggregation: RemotePrefill, endpoints: tuple[str, ...]) -> None:
        """Take part in disaggregated prefill/decode as `disaggregation.role`; `endpoints`:
        the workers' KV-transfer endpoint ids (in this engine's info). Before the first request."""
        self.disaggregation = disaggregation
        self._info = replace(self._info, role=disaggregation.role, kv_transfer_endpoints=endpoints)

    def admit(self, request: EngineCoreRequest) -> None:
        """Into the inbox: the engine-loop thread admits it before the next step (event loop only)."""
        with self._inbox_lock:
            self._new_requests.append(request)
        self._wake.set()

    def deliver(self, request_id: str, item: Item) -> None:
        """An output (or the exception that ends it) to `request_id`'s stream, if still open (event loop)."""
        self._deliver([(request_id, item)])

    async def call_in_loop(self, fn: Callable[[], T]) -> T:
        """`fn()` on the engine-loop thread between two steps (the only thread that may change the
        core); its result or its exception. EngineDeadError once the engine has stopped."""
        if self._error is not None:
            raise self._error
        future = asyncio.get_running_loop().create_future()
        with self._inbox_lock:
            self._calls.append((fn, future))
        self._wake.set()
        return await future

    def call_soon_in_loop(self, fn: Callable[[], object]) -> None:
        """`fn()` on the engine-loop thread, not waited for (from cleanup that cannot await)."""
        with self._inbox_lock:
            self._calls.append((fn, None))
        self._wake.set()

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Idempotent; each open stream of these ids ends with finish_reason "abort"."""
        self._abort_soon(request_ids)

    async def stats(self) -> EngineStats:
        return self.core.stats()

    async def match_prefix(self, block_hashes: Sequence[bytes]) -> PrefixMatch:
        return self.core.match_prefix(block_hashes)

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        await self.call_in_loop(lambda: self.core.add_lora(lora_name, lora_path))

    async def unload_lora_adapter(self, lora_name: str) -> None:
        await self.call_in_loop(lambda: self.core.remove_lora(lora_name))

    @property
    def identity(self) -> EngineIdentity:
        return EngineIdentity(self._info.engine_id, self._info.epoch)

    def request_cache_snapshot(self) -> None:
        """Have the engine-loop thread record the prefix cache's whole state into the core's
        `kv_events` between two steps (at once when idle), ordered after every event before it.
        Requests made before it runs are served by one snapshot. Any thread."""
        self._snapshot_wanted.set()
        self._wake.set()

    async def is_healthy(self) -> bool:
        return self._error is None

    async def wait_until_unhealthy(self) -> None:
        await self._dead.wait()

    def _abort_soon(self, request_ids: Iterable[str]) -> None:
        if self._error is None:
            with self._inbox_lock:
                self._aborts.update(request_ids)
            self._wake.set()

    # ------------------------------------------------------------------ the engine-loop thread

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()  # before taking the inbox: a later put sets it again
                items = self._take_inbox()
                if self._snapshot_wanted.is_set():
                    self._snapshot_wanted.clear()  # before recording: a later request gets a later snapshot
                    self.core.record_cache_snapshot()
                if not self._has_pending_work():
                    if items:
                        self._send(items)
                    self._wake.wait(self._idle_wait())
                    if self._idle_check_due():
                        self.worker.check_alive()
                    continue
                items += self._step()
                if self.idle_check_interval is not None:  # a step is a check: the next one, an interval after it
                    self._next_idle_check = time.monotonic() + self.idle_check_interval
                self._send(items)
        except Exception as exc:  # the worker died or failed a step: fatal, see the module docstring
            logger.exception("engine step failed")
            # The reason stays in the log (and in __cause__, in-process): callers learn that the
            # engine is dead, not how its worker failed.
            error = EngineDeadError("engine step failed: the engine stopped serving")
            error.__cause__ = exc
            self._loop.call_soon_threadsafe(self._fail, error)

    def _idle_wait(self) -> float | None:
        """How long the idle loop sleeps: until its next liveness check or the next lease's expiry."""
        now = time.monotonic()
        until_check = None if self.idle_check_interval is None else max(0.0, self._next_idle_check - now)
        expiry = self.core.kv_cache_manager.next_lease_expiry()
        if expiry is None:
            return until_check
        until_expiry = max(0.0, expiry - now)
        return until_expiry if until_check is None else min(until_expiry, until_check)

    def _idle_check_due(self) -> bool:
        """Whether the idle loop checks its worker now: once an interval, counted from the last check
        or step, so that frequent wake-ups (calls, aborts, snapshots) cannot starve the check."""
        if self.idle_check_interval is None or self._stopping:
            return False
        now = time.monotonic()
        if now < self._next_idle_check:
            return False
        self._next_idle_check = now + self.idle_check_interval
        return True

    def _run_calls(self, calls: list[tuple[Callable[[], object], asyncio.Future | None]]) -> None:
        for fn, future in calls:
            try:
                result, error = fn(), None
            except Exception as exc:  # the caller's to handle: it gets the exception
                result, error = None, exc
                if future is None:
                    logger.exception("engine-loop call failed")
            if future is not None:
                self._loop.call_soon_threadsafe(_settle, future, result, error)

    def _take_inbox(self) -> list[tuple[str, Item]]:
        """Run the queued calls, admit new requests (a refusal goes to its stream), apply aborts,
        and free the KV leases that have expired."""
        with self._inbox_lock:
            new_requests, self._new_requests = self._new_requests, []
            aborts, self._aborts = self._aborts, set()
            calls, self._calls = self._calls, []
        self._run_calls(calls)
        if self.core.kv_cache_manager.leases:
            expired = self.core.kv_cache_manager.expire_leases(time.monotonic())
            if expired and self.disaggregation is not None:
                self.disaggregation.record_expired(len(expired))
        items: list[tuple[str, Item]] = []
        for request in new_requests:
            if request.request_id in aborts:
                continue  # its stream is already closed
            try:
                self.core.add_request(request)
            except Exception as exc:  # ValueError, or a refusal such as a full waiting queue
                items.append((request.request_id, exc))
                continue
            if self.metrics is not None:
                self.metrics.add_request(request)
        if aborts:
            self.core.abort_requests(aborts)
            if self.metrics is not None:
                self.metrics.record_aborted(aborts)
            items += [(request_id, EngineCoreOutput(request_id, [], finish_reason="abort")) for request_id in aborts]
        return items

    def _has_pending_work(self) -> bool:
        # Finished ids (and unloaded adapters) alone still need a step: the worker must drop their state.
        return (self.core.has_unfinished_requests() or self.core.has_finished_requests()
                or self.core.has_removed_loras())

    def _step(self) -> list[tuple[str, Item]]:
        start = time.perf_counter()
        scheduler_output = self.core.schedule()
        if (scheduler_output.is_empty and not scheduler_output.finished_req_ids
                and not scheduler_output.removed_lora_ids):
            # Nothing could be scheduled this time (cannot last: running requests free their
            # blocks as they finish); wait a little, or until new work arrives.
            self._wake.wait(IDLE_SCHEDULE_WAIT)
            return _ending_alone(self.core.take_grammar_outputs())  # e.g. constraints that failed to compile
        rpc_start = time.perf_counter()
        runner_output = self.worker.execute_model(scheduler_output)
        rpc_seconds = time.perf_counter() - rpc_start
        outputs = self.core.update_from_output(scheduler_output, runner_output)
        step_seconds = time.perf_counter() - start
        self.core.record_step_time(scheduler_output, step_seconds)
        if self.metrics is not None:
            self.metrics.record_step(scheduler_output, outputs, step_seconds, rpc_seconds)
        return _ending_alone(outputs)

    def _send(self, items: list[tuple[str, Item]]) -> None:
        if items:
            self._loop.call_soon_threadsafe(self._deliver, items)

    # ------------------------------------------------------------------ back on the event loop

    def _deliver(self, items: list[tuple[str, Item]]) -> None:
        for request_id, item in items:
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(item)

    def _fail(self, error: EngineDeadError) -> None:
        """Called once the engine-loop thread has ended (or never ran): the core is ours now."""
        if self._error is None:
            self._error = error
            self._dead.set()
        with self._inbox_lock:
            self._new_requests.clear()
            self._aborts.clear()
            calls, self._calls = self._calls, []
        for _, future in calls:
            if future is not None and not future.done():
                future.set_exception(self._error)
        self.core.abort_all()
        for queue in self._queues.values():
            queue.put_nowait(self._error)



def _ending_alone(outputs: list[EngineCoreOutput]) -> list[tuple[str, Item]]:
    """A request that failed alone ends its stream with the reason, as a refusal at admission would."""
    return [(o.request_id, o if o.error is None else ValueError(o.error)) for o in outputs]


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    """A call_in_loop future's outcome, on the event loop (its awaiter may have gone: cancelled)."""
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
