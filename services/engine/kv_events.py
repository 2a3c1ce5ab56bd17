"""Events the block pool emits when its prefix cache changes.

The prefix index (Redis, in-memory, ...) is fed only from these, so they mirror the pool's map from
block hash to cached block exactly: a `BlockStored` for every hash that enters the map, a
`BlockRemoved` for every hash that leaves it, `AllBlocksCleared` when the map is emptied at once.
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


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
