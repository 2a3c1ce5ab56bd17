"""A processor's own copy of the Redis prefix index, kept current from the index's events stream, so
a routing decision looks a prompt up in memory instead of waiting for a round trip to Redis on a busy
event loop (the wait, not Redis, was what routing latency measured: docs/features/routing.md).

    engines ──apply──▶ Redis: blocks + {ns}:events ──XREAD──▶ PrefixIndexReplica ──longest_prefix──▶ router
                                                                (MemoryPrefixIndex)

It loads a snapshot (every engine's epoch and blocks, and the id of the last event they include),
then applies the stream's entries in order. Each entry names the one before it, so a replica that
missed some (the stream was trimmed past it; Redis restarted empty) notices at the next entry and
reloads. Which engines are alive, and their loads, it reads with `engines()` every `refresh_s`: a
lookup counts only engines alive in the epoch it holds their blocks for.

While Redis cannot be read, lookups raise ConnectionError as the Redis index's own do, and the router
routes by load; once the reader gets through again lookups answer again (the copy reads on from the
last entry it applied, or reloads if Redis lost the stream meanwhile). Updates
(apply, heartbeat, clear, sweep) go to Redis itself.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.common.hashing import BlockHash
from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from services.prefix_index.index import EngineLoad, EngineState, StaleEpochError
from services.prefix_index.memory import MemoryPrefixIndex
from services.prefix_index.redis_index import RedisAccess, RedisPrefixIndex, redis_client, split_hashes, valid_epoch

logger = logging.getLogger(__name__)

BLOCK_S = 0.25  # how long one stream read waits for news; also the longest the reader goes unheard
REFRESH_S = 0.25  # the engines' liveness and loads are re-read this often
_ENTRY_HEAD = (b"prev", b"id", b"epoch")
_REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, ConnectionError)


class _Gap(Exception):
    """The stream's next entry does not follow the last one applied: entries were missed."""


class PrefixIndexReplica:
    """A PrefixIndex whose lookups (`longest_prefix`, `engines`) are answered from memory. `start()`
    it inside the running event loop; `close()` it."""

    def __init__(self, index: RedisPrefixIndex, reader: aioredis.Redis, timeout_s: float,
                 refresh_s: float = REFRESH_S) -> None:
        self._index = index
        self._reader = reader  # a connection of its own: its reads wait up to BLOCK_S for news
        self.timeout_s = timeout_s
        self.refresh_s = refresh_s
        self._stream = f"{index.namespace}:events"
        self._local = MemoryPrefixIndex(math.inf)  # liveness is Redis's (self._live), not a local TTL
        self._live: dict[str, EngineState] = {}
        self._live_read_at = -math.inf
        self._last_id: bytes | None = None  # the last entry applied; None: nothing loaded
        self._loaded = asyncio.Event()
        self._answering = False  # loaded, and the last read of Redis got through
        self._down_logged = False
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def connect(cls, url: str | RedisAccess, timeout_s: float = 0.5, namespace: str = "kvmesh:pi",
                heartbeat_ttl_s: float = 10.0) -> PrefixIndexReplica:
        """A replica of the index at `url` (see RedisPrefixIndex.connect); not started."""
        return cls(RedisPrefixIndex.connect(url, timeout_s, namespace, heartbeat_ttl_s),
                   redis_client(url, timeout_s + BLOCK_S), timeout_s)

    async def check_access(self, where: str) -> None:
        """RedisPrefixIndex.check_access: PermissionError when Redis refuses our credentials."""
        await self._index.check_access(where)

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._stopping = False
            self._task = asyncio.create_task(self._follow())

    async def stop(self) -> None:
        """Stops following once the read under way returns (within BLOCK_S): redis-py's asyncio
        client does not come back from a read cancelled midway. The copy stays as it is; lookups
        answer from it until `start` resumes from there."""
        if self._task is None:
            return
        self._stopping = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), BLOCK_S + self.timeout_s + 1.0)
        except TimeoutError:
            self._task.cancel()
        self._task = None

    async def close(self) -> None:
        await self.stop()
        await self._reader.aclose()
        await self._index.close()

    # ------------------------------------------------------------------ lookups (from memory)

    async def longest_prefix(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        await self._ready()
        held = await self._local.longest_prefix(block_hashes)
        if not held:
            return held
        epochs = {engine_id: state.epoch for engine_id, state in (await self._local.engines()).items()}
        return {engine_id: n for engine_id, n in held.items()
                if (state := self._live.get(engine_id)) is not None and state.epoch == epochs[engine_id]}

    async def engines(self) -> dict[str, EngineState]:
        await self._ready()
        return dict(self._live)

    async def _ready(self) -> None:
        """Returns at once while the copy is current; raises ConnectionError while Redis cannot be
        read. Before the first load, waits for it up to the timeout (a processor's first requests)."""
        if self._last_id is None and not self._loaded.is_set() and self._task is not None:
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._loaded.wait()
            except TimeoutError:
                pass
        if not self._answering:
            raise ConnectionError("prefix index replica: Redis unreachable (or the copy is reloading)")

    async def sync(self) -> None:
        """Waits until the copy holds everything Redis held when called (tests; a new processor)."""
        last = await self._index_last_id()
        while not self._answering or self._last_id is None or (last and _stream_id(self._last_id) < _stream_id(last)):
            await asyncio.sleep(0.005)
        await self._refresh_live()

    # ------------------------------------------------------------------ updates (to Redis)

    async def apply(self, engine_id: str, epoch: int, events: Sequence[KVCacheEvent]) -> bool:
        return await self._index.apply(engine_id, epoch, events)

    async def heartbeat(self, engine_id: str, epoch: int, load: EngineLoad) -> bool:
        return await self._index.heartbeat(engine_id, epoch, load)

    async def clear(self, engine_id: str) -> None:
        await self._index.clear(engine_id)

    async def sweep(self) -> list[str]:
        return await self._index.sweep()

    # ------------------------------------------------------------------ following the stream

    async def _follow(self) -> None:
        backoff = 0.05
        while not self._stopping:
            try:
                if self._last_id is None:  # else resume where a stop() left off
                    await self._load()
                backoff = 0.05
                while not self._stopping:
                    await self._read()
            except _Gap as e:
                logger.info("prefix index replica: %s; reloading", e)
                self._answering, self._last_id = False, None
            except Exception as e:  # noqa: BLE001 - Redis down (or a bug): lookups fail meanwhile
                # The copy is kept: if Redis comes back with the same stream, reading on from the last
                # entry applied is enough; if it lost it, the next entry's `prev` says so (a reload).
                self._answering = False
                if not isinstance(e, _REDIS_ERRORS):
                    self._last_id = None
                if not self._down_logged:
                    logger.log(logging.WARNING if isinstance(e, _REDIS_ERRORS) else logging.ERROR,
                               "prefix index replica: lookups fail until it reloads: %s", e,
                               exc_info=not isinstance(e, _REDIS_ERRORS))
                    self._down_logged = True
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, 1.0)

    async def _load(self) -> None:
        last_id, engines = await self._index.snapshot()
        local = MemoryPrefixIndex(math.inf)
        for engine_id, (epoch, hashes) in engines.items():
            await local.apply(engine_id, epoch, [_stored(hashes)])
        self._local = local
        await self._refresh_live()
        self._last_id = last_id
        self._loaded.set()
        self._now_answering()

    def _now_answering(self) -> None:
        self._answering = True
        if self._down_logged:
            logger.info("prefix index replica: Redis answers again")
            self._down_logged = False

    async def _read(self) -> None:
        reply = await self._reader.xread({self._stream: self._last_id or b"0-0"}, count=1000,
                                         block=round(BLOCK_S * 1000))
        for _, entries in reply or ():
            for entry_id, fields in entries:
                await self._apply_entry(entry_id, fields)
        if time.monotonic() - self._live_read_at >= self.refresh_s:
            await self._refresh_live()
        if not self._answering:
            self._now_answering()

    async def _apply_entry(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        if fields.get(b"prev") != self._last_id:
            raise _Gap(f"entry {entry_id!r} follows {fields.get(b'prev')!r}, the last applied was {self._last_id!r}")
        if not valid_epoch(fields.get(b"epoch", b"")):
            raise _Gap(f"entry {entry_id!r} carries no valid epoch")  # written by no engine: reload
        engine_id, epoch = fields[b"id"].decode(), int(fields[b"epoch"])
        ops = sorted((key for key in fields if key not in _ENTRY_HEAD), key=lambda key: int(key[:-1]))
        if any(key.endswith(b"F") for key in ops):
            await self._local.clear(engine_id)
        else:
            events = [_event(key[-1:], fields[key]) for key in ops]
            try:
                await self._local.apply(engine_id, epoch, events)
            except StaleEpochError as e:  # cannot follow an ordered stream: the copy is off
                raise _Gap(str(e)) from e
        self._last_id = entry_id

    async def _refresh_live(self) -> None:
        self._live = await self._index.engines()
        self._live_read_at = time.monotonic()

    async def _index_last_id(self) -> bytes:
        try:
            newest = await self._reader.xrevrange(self._stream, count=1)
        except _REDIS_ERRORS as e:
            raise ConnectionError(f"prefix index replica: Redis unreachable: {e}") from e
        return newest[0][0] if newest else b""


def _stored(hashes: list[BlockHash]) -> BlockStored:
    return BlockStored(hashes, None, [], 0)  # the index reads only the hashes


def _event(op: bytes, packed: bytes) -> KVCacheEvent:
    if op == b"S":
        return _stored(split_hashes(packed))
    if op == b"R":
        return BlockRemoved(split_hashes(packed))
    if op == b"C":
        return AllBlocksCleared()
    raise _Gap(f"unknown op {op!r} in the events stream")


def _stream_id(entry_id: bytes) -> tuple[int, int]:
    """An entry id as a comparable pair; b"" (no entry) first."""
    ms, _, seq = entry_id.partition(b"-")
    return int(ms or -1), int(seq or 0)
