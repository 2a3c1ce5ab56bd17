"""The in-memory prefix index: one process, exact. Used in-process (no Redis) and as the model the
Redis implementation is tested against."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.common.hashing import BlockHash
from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, CacheSnapshot, KVCacheEvent
from services.prefix_index.index import EngineLoad, EngineState, StaleEpochError, validate_engine


@dataclass(slots=True)
class _Engine:
    epoch: int
    blocks: set[BlockHash]  # what this epoch holds: the reverse map, so clearing costs O(its blocks)
    expires_at: float  # clock seconds
    load: EngineLoad | None = None


class MemoryPrefixIndex:
    def __init__(self, heartbeat_ttl_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if heartbeat_ttl_s <= 0:
            raise ValueError(f"heartbeat_ttl_s must be positive, got {heartbeat_ttl_s}")
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self._clock = clock
        self._engines: dict[str, _Engine] = {}
        # block hash -> ids of engines holding it (in their current epoch: older epochs are purged).
        self._holders: dict[BlockHash, set[str]] = {}

    def _touch(self, engine_id: str, epoch: int) -> tuple[_Engine, bool]:
        """The engine's record for `epoch`, purging an older incarnation first; extends its life.
        Also whether that record existed before (see PrefixIndex.apply)."""
        validate_engine(engine_id, epoch)
        engine = self._engines.get(engine_id)
        if engine is not None and engine.epoch > epoch:
            raise StaleEpochError(f"{engine_id}: epoch {epoch} is older than the current {engine.epoch}")
        if engine is not None and engine.epoch < epoch:
            self._drop_blocks(engine_id, engine)
            engine = None
        known = engine is not None
        if engine is None:
            engine = self._engines[engine_id] = _Engine(epoch, set(), 0.0)
        elif not self._alive(engine):
            engine.load = None  # a load older than the TTL is not worth reporting (Redis expires it too)
        engine.expires_at = self._clock() + self.heartbeat_ttl_s
        return engine, known

    def _drop_blocks(self, engine_id: str, engine: _Engine) -> None:
        for block_hash in engine.blocks:
            holders = self._holders[block_hash]
            holders.discard(engine_id)
            if not holders:
                del self._holders[block_hash]
        engine.blocks.clear()

    def _alive(self, engine: _Engine) -> bool:
        return self._clock() < engine.expires_at

    async def apply(self, engine_id: str, epoch: int, events: Sequence[KVCacheEvent]) -> bool:
        engine, known = self._touch(engine_id, epoch)
        for event in events:
            if isinstance(event, (BlockStored, CacheSnapshot)):
                if isinstance(event, CacheSnapshot):
                    self._drop_blocks(engine_id, engine)
                for block_hash in event.block_hashes:
                    engine.blocks.add(block_hash)
                    self._holders.setdefault(block_hash, set()).add(engine_id)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    if block_hash in engine.blocks:
                        engine.blocks.remove(block_hash)
                        holders = self._holders[block_hash]
                        holders.remove(engine_id)
                        if not holders:
                            del self._holders[block_hash]
            elif isinstance(event, AllBlocksCleared):
                self._drop_blocks(engine_id, engine)
            else:
                raise TypeError(f"not a KV cache event: {event!r}")
        return known

    async def heartbeat(self, engine_id: str, epoch: int, load: EngineLoad) -> bool:
        engine, known = self._touch(engine_id, epoch)
        engine.load = load
        return known

    async def longest_prefix(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        if not block_hashes:
            return {}
        matched = {
            engine_id: 1
            for engine_id in self._holders.get(block_hashes[0], ())
            if self._alive(self._engines[engine_id])
        }
        active = set(matched)
        for block_hash in block_hashes[1:]:
            active &= self._holders.get(block_hash, set())
            if not active:
                break
            for engine_id in active:
                matched[engine_id] += 1
        return matched

    async def engines(self) -> dict[str, EngineState]:
        return {
            engine_id: EngineState(engine.epoch, engine.load)
            for engine_id, engine in self._engines.items()
            if self._alive(engine)
        }

    async def clear(self, engine_id: str) -> None:
        engine = self._engines.pop(engine_id, None)
        if engine is not None:
            self._drop_blocks(engine_id, engine)

    async def sweep(self) -> list[str]:
        expired = sorted(engine_id for engine_id, engine in self._engines.items() if not self._alive(engine))
        for engine_id in expired:
            await self.clear(engine_id)
        return expired

    async def close(self) -> None:
        pass

    def check_integrity(self) -> None:
        """The forward map (block -> holders) and the reverse sets (engine -> blocks) agree exactly."""
        forward = {(h, e) for h, holders in self._holders.items() for e in holders}
        reverse = {(h, e) for e, engine in self._engines.items() for h in engine.blocks}
        assert forward == reverse, f"forward and reverse maps differ: {forward ^ reverse}"
        assert all(self._holders.values()), "an empty holder set was left behind"
