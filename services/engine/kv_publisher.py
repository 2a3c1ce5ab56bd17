"""KVPublisher: feeds the shared prefix index from one engine's block pool, off the critical path.

    engine-loop thread: block pool -> KVEventQueue (bounded; record() never waits for anyone)
    event loop:         every poll_interval: take the queue -> index.apply(id, epoch, events)
                        every heartbeat_ttl / 3: index.heartbeat(id, epoch, load)

It runs as an asyncio task on the engine service's event loop, never on the engine-loop thread, so a
full, slow or absent Redis costs the index freshness, never a step.

Resync. The index may miss what the pool holds: the queue overflowed (the batch says resync), a call
failed (its events are lost, and Redis may have restarted empty), or the index did not know this
engine (an update returned False: first word, sweep, clear, lost data). Then the publisher asks the
engine for a snapshot (AsyncEngine.request_cache_snapshot): the engine-loop thread records a
CacheSnapshot into the queue between two steps, so it is ordered against every other event, and the
index applies it as "clear, then exactly these" atomically. While the index is unreachable the
publisher drops the queued events (the snapshot will supersede them) and tries a heartbeat every
heartbeat interval; the first that succeeds asks for the snapshot.

A live newer incarnation of this engine id (StaleEpochError) stands this one down: it drops its
events and tries a heartbeat every heartbeat interval, and leaves the index alone at close while
standing down (the entries are the newer engine's). Redis refuses only while that epoch's heartbeat
lives, so a forged epoch silences an engine for one heartbeat TTL at most: the first heartbeat that
gets through republishes the whole cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from services.common.clients import EngineStats
from services.common.kv_events import CacheSnapshot, KVCacheEvent
from services.engine.async_engine import AsyncEngine
from services.engine.kv_event_queue import KVEventQueue
from services.engine.metrics import PublisherMetrics
from services.prefix_index import EngineLoad, PrefixIndex, StaleEpochError

logger = logging.getLogger(__name__)

POLL_INTERVAL = 0.02  # seconds between takes of the queue: the index lags the pool by about this


def engine_load(stats: EngineStats) -> EngineLoad:
    usage = stats.num_used_blocks / stats.num_total_blocks if stats.num_total_blocks else 0.0
    return EngineLoad(stats.num_running, stats.num_waiting, stats.num_total_blocks - stats.num_used_blocks, usage)


def since_last_snapshot(events: list[KVCacheEvent]) -> tuple[list[KVCacheEvent], bool]:
    """The events from the last CacheSnapshot on (it supersedes everything before it), and whether
    there was one."""
    for i in range(len(events) - 1, -1, -1):
        if isinstance(events[i], CacheSnapshot):
            return events[i:], True
    return events, False


class KVPublisher:
    """Publishes `engine`'s cache events (its core's `kv_events`, which must be attached) and load to
    `index`, as `engine.identity`. Owns `index`: `close()` clears this engine from it and closes it."""

    def __init__(self, index: PrefixIndex, engine: AsyncEngine, heartbeat_ttl: float,
                 metrics: PublisherMetrics | None = None, *, poll_interval: float = POLL_INTERVAL,
                 close_timeout: float = 1.0) -> None:
        if engine.core.kv_events is None:
            raise ValueError("the engine records no KV events: create it with kv_events=KVEventQueue()")
        if not engine.identity.engine_id:
            raise ValueError("the engine has no id: create it with identity=EngineIdentity(address, epoch)")
        if heartbeat_ttl <= 0 or poll_interval <= 0:
            raise ValueError(f"heartbeat_ttl and poll_interval must be positive, got {heartbeat_ttl}, {poll_interval}")
        self.index = index
        self.engine = engine
        self.engine_id, self.epoch = engine.identity
        self.queue: KVEventQueue = engine.core.kv_events
        self.heartbeat_interval = heartbeat_ttl / 3
        self.poll_interval = poll_interval
        self.close_timeout = close_timeout
        self.metrics = metrics
        self.stale = False  # a live newer incarnation owns this id: standing down until it is gone
        self.num_failures = 0  # failed index calls since start (also in the metrics, when given)
        self.num_resyncs = 0
        self._reachable = True  # the last index call succeeded
        self._next_heartbeat = 0.0  # time.monotonic() of the next heartbeat (the first: at once)
        self._num_overflows = 0  # of the queue, counted so far
        self._task: asyncio.Task | None = None
        self._closed = False

    def start(self) -> None:
        assert self._task is None, "already started"
        self._task = asyncio.create_task(self._run(), name="kv-publisher")

    async def close(self) -> None:
        """Stop publishing, clear this engine from the index (best effort, bounded: a router should
        not send requests to an engine that is going away), close the index's client. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.queue.close()
        if not self.stale:
            try:
                async with asyncio.timeout(self.close_timeout):
                    await self.index.clear(self.engine_id)
            except Exception as exc:  # an unreachable index expires us by its heartbeat TTL instead
                logger.warning("prefix index: could not clear engine %s at shutdown (%r); its entries expire "
                               "with its heartbeat", self.engine_id, exc)
        await self.index.close()

    async def _run(self) -> None:
        while True:
            await self.publish_once()
            await asyncio.sleep(self.poll_interval)

    async def publish_once(self) -> None:
        """Send what the queue holds, and a heartbeat when one is due. Never raises: an index that
        fails or refuses is retried every heartbeat interval."""
        batch = self.queue.take()
        if self.queue.num_overflows != self._num_overflows:
            if self.metrics is not None:
                self.metrics.queue_overflows.inc(self.queue.num_overflows - self._num_overflows)
            self._num_overflows = self.queue.num_overflows
        if not self._reachable or self.stale:
            # The events are lost anyway: the snapshot asked for once the index answers replaces them.
            await self._heartbeat_when_due()
            return
        if batch.resync:
            self._resync("the event queue overflowed")
        events, has_snapshot = since_last_snapshot(batch.events)
        try:
            if events:
                known = await self.index.apply(self.engine_id, self.epoch, events)
                if self.metrics is not None:
                    self.metrics.events_published.inc(len(events))
                if not known and not has_snapshot:  # a snapshot is the whole state: nothing is missing
                    self._resync("the index did not know this engine")
        except StaleEpochError as exc:
            self._stand_down(exc)
            return
        except Exception as exc:  # unreachable, slow, or refusing (a full Redis): never fatal here
            self._failed(exc)
            return
        await self._heartbeat_when_due()

    async def _heartbeat_when_due(self) -> None:
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.heartbeat_interval
        try:
            known = await self.index.heartbeat(self.engine_id, self.epoch, engine_load(await self.engine.stats()))
        except StaleEpochError as exc:
            self._stand_down(exc)
            return
        except Exception as exc:
            self._failed(exc)
            return
        if self.stale:
            self.stale = False
            self._reachable = True
            logger.warning("prefix index: engine %s's newer epoch is gone; this one publishes again", self.engine_id)
            self._resync("the newer epoch is gone")
        elif not self._reachable:
            self._reachable = True
            logger.info("prefix index: reachable again; republishing engine %s", self.engine_id)
            self._resync("the index was unreachable")
        elif not known:
            self._resync("the index did not know this engine")

    def _stand_down(self, exc: StaleEpochError) -> None:
        if not self.stale:  # once per stand-down, not once per try
            logger.error("prefix index: a live newer incarnation of engine %s publishes now (%s); this one stands "
                         "down, retrying every %.1fs", self.engine_id, exc, self.heartbeat_interval)
        self.stale = True
        self._next_heartbeat = time.monotonic() + self.heartbeat_interval

    def _failed(self, exc: Exception) -> None:
        self.num_failures += 1
        if self.metrics is not None:
            self.metrics.publish_failures.inc()
        if self._reachable:  # once per outage, not once per poll
            logger.warning("prefix index: call failed (%r); retrying every %.1fs", exc, self.heartbeat_interval)
        self._reachable = False
        self._next_heartbeat = time.monotonic() + self.heartbeat_interval

    def _resync(self, why: str) -> None:
        logger.info("prefix index: republishing engine %s: %s", self.engine_id, why)
        self.num_resyncs += 1
        if self.metrics is not None:
            self.metrics.resyncs.inc()
        self.engine.request_cache_snapshot()
