"""The prefix-cache index interface.

An engine is named by `engine_id` (its address) and an `epoch`: a non-negative integer that grows with
every start of the engine (its start time in nanoseconds will do). A restarted engine at the same address
comes back with a larger epoch; the index then drops everything the old incarnation published, and
updates that still carry an older epoch are refused (`StaleEpochError`), so a new incarnation never
inherits stale blocks.

Liveness: every `apply` and `heartbeat` keeps an engine alive for `heartbeat_ttl_s`. An engine whose
heartbeat expired is gone: `longest_prefix` and `engines` ignore it at once, and `sweep` deletes what it
left behind. If it comes back with the same epoch, its entries count again (they were never wrong, only
possibly incomplete: the index may miss blocks, which costs hits, never correctness).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from services.common.hashing import BlockHash
from services.common.kv_events import KVCacheEvent


class StaleEpochError(ValueError):
    """An update carried an epoch older than the engine's current one (a dead incarnation's publisher)."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1

    def __post_init__(self) -> None:
        if min(self.num_running, self.num_waiting, self.num_free_blocks) < 0:
            raise ValueError(f"load counts must be non-negative: {self}")
        if not 0.0 <= self.kv_cache_usage <= 1.0:
            raise ValueError(f"kv_cache_usage must be in [0, 1], got {self.kv_cache_usage}")


@dataclass(frozen=True, slots=True)
class EngineState:
    """A live engine: its current epoch and its last reported load (None before its first heartbeat)."""

    epoch: int
    load: EngineLoad | None


class PrefixIndex(Protocol):
    async def apply(self, engine_id: str, epoch: int, events: Sequence[KVCacheEvent]) -> bool:
        """Apply one engine's block-pool events in order, atomically, and keep the engine alive.
        Returns whether the index knew this epoch of the engine before the call: False when the call
        (re)created it (its first word, or after a `clear`, a `sweep`, or a Redis that lost its
        data), and the publisher should republish the engine's whole cache.
        Raises StaleEpochError if `epoch` is older than the engine's current epoch."""
        ...

    async def heartbeat(self, engine_id: str, epoch: int, load: EngineLoad) -> bool:
        """Record the engine's load and keep it alive; returns as `apply` does. Raises StaleEpochError
        like `apply`."""
        ...

    async def longest_prefix(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """For each live engine holding `block_hashes[0]`, how many leading blocks of the chain it holds
        (counting stops at its first miss). Engines with no match are absent."""
        ...

    async def engines(self) -> dict[str, EngineState]:
        """Live engines (heartbeat not expired) by id."""
        ...

    async def clear(self, engine_id: str) -> None:
        """Forget the engine entirely: its blocks (every epoch), its epoch and its load."""
        ...

    async def sweep(self) -> list[str]:
        """Clear every engine whose heartbeat expired; returns their ids, sorted."""
        ...

    async def close(self) -> None: ...


def validate_engine(engine_id: str, epoch: int) -> None:
    if not engine_id:
        raise ValueError("engine_id must not be empty")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
