"""Events the block pool emits when its prefix cache changes, as every consumer reads them.

The prefix index (Redis, in-memory, ...) is fed only from these, so they mirror the pool's map from
block hash to cached block exactly: a `BlockStored` for every hash that enters the map, a
`BlockRemoved` for every hash that leaves it, `AllBlocksCleared` when the map is emptied at once.
`CacheSnapshot` is the whole map at one moment, recorded when the consumer asks for it (a resync).
The engine records them (services/engine/kv_event_queue.py); the prefix index applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A run of consecutive full blocks entered the cache.

    `block_hashes[i]` names the block holding `token_ids[i * block_size:(i + 1) * block_size]`;
    `parent_block_hash` is the hash the first of them is chained from (None for a prompt's first block).
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """These blocks were evicted from the cache (their memory was reused)."""

    block_hashes: list[BlockHash]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (`reset_prefix_cache`)."""


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    """All cleared, then exactly these blocks are cached: the pool's whole map between two steps,
    recorded at the publisher's request so that a resync is ordered against the other events."""

    block_hashes: list[BlockHash]


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared | CacheSnapshot
