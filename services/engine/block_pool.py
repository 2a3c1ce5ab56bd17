"""The pool of KV-cache blocks: ref counts, the free queue (an LRU) and the prefix cache.

A block is in exactly one of two states:

    in use   ref_cnt >= 1, owned by that many requests, not in the free queue
    free     ref_cnt == 0, in the free queue; it may still carry a hash (a *cached* free block) that
             a prefix hit can revive until the block is handed out again and its hash evicted

Free queue order (the front is handed out first):

    head -> [unhashed free blocks ...][cached free blocks, least recently freed first ...] <- tail

so an unhashed block is always reused before any cached content is evicted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from services.common.hashing import BlockHash
from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, CacheSnapshot
from services.engine.kv_event_queue import KVEventQueue


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Hash of the full block's tokens (parent-chained); None while the block is partial or uncached.
    block_hash: BlockHash | None = None
    # Intrusive links of the free queue; both None while the block is not in it.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeKVCacheBlockQueue:
    """A doubly linked list of free blocks threaded through the blocks themselves.

    Every operation is O(1) (O(n) for `popleft_n(n)`), including removing a block from the middle when
    a prefix hit revives it. Two sentinels spare the edge cases:

        head <-> b_0 <-> b_1 <-> ... <-> b_{n-1} <-> tail
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free block available")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} available")
        if n <= 0:
            return []
        popped: list[KVCacheBlock] = []
        block = self._head.next_free
        for _ in range(n):
            popped.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        # Splice the whole run out at once: head <-> (first block left).
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= n
        return popped

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks front to back (O(n); for tests and integrity checks)."""
        blocks = []
        block = self._head.next_free
        while block is not self._tail:
            blocks.append(block)
            block = block.next_free
        return blocks

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"block {block.block_id} is already free"
        nxt = prev.next_free
        block.prev_free = prev
        block.next_free = nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def _unlink(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1


class BlockPool:
    """All KV blocks of one engine, and the map from block hash to the block that caches it.

    Invariant: `block.block_hash is not None` exactly when `self._cached[block.block_hash] is block`.
    A block whose hash another block already caches (two requests computed the same prefix at once)
    stays unhashed, so the map, the events and the index built from them never disagree.

    Events go to `events`, the queue of the one consumer; with none attached nothing is recorded.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 events: KVEventQueue | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self.events = events

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` blocks from the front of the free queue, evicting whatever they cached."""
        if n > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks: only {self.free_block_queue.num_free_blocks} free")
        blocks = self.free_block_queue.popleft_n(n)
        evicted: list[BlockHash] = []
        for block in blocks:
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
        if evicted and self.events is not None:
            self.events.record(BlockRemoved(evicted))
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks; a free one leaves the free queue (O(1))."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(
        self,
        request_blocks: list[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        token_ids: Sequence[int],
    ) -> None:
        """Cache `request_blocks[num_cached_blocks:num_full_blocks]`, full blocks whose tokens are final.

        `block_hashes` and `token_ids` are the request's (all of them, indexed from its first block).
        Emits one `BlockStored` per run of consecutive newly cached blocks: one in the usual case, none
        when every block in the range duplicates a block cached already.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        assert num_full_blocks <= len(block_hashes), "caching a block whose hash is not known yet"
        assert num_full_blocks * self.block_size <= len(token_ids), "caching a block that is not full"
        run_start: int | None = None  # first block index of the current run of newly cached blocks
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = request_blocks[i], block_hashes[i]
            assert block.block_hash is None, f"block {block.block_id} is cached already"
            if block_hash in self._cached:
                # Duplicate content: keep the existing entry; this block stays unhashed and is reused first.
                if run_start is not None:
                    self._emit_stored(block_hashes, token_ids, run_start, i)
                    run_start = None
                continue
            block.block_hash = block_hash
            self._cached[block_hash] = block
            if run_start is None:
                run_start = i
        if run_start is not None:
            self._emit_stored(block_hashes, token_ids, run_start, num_full_blocks)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, given in eviction-preference order (first evicted first).

        A block reaching ref_cnt 0 returns to the free queue: cached ones to the tail (evicted last,
        in the order given), unhashed ones to the head (reused first).
        """
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"freeing block {block.block_id} with ref_cnt {block.ref_cnt}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self.free_block_queue.append(block)
                else:
                    self.free_block_queue.appendleft(block)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; only possible while no block is in use. Returns whether it did."""
        if self.free_block_queue.num_free_blocks != self.num_blocks:
            return False
        if self.enable_caching:
            for block in self._cached.values():
                block.block_hash = None
            self._cached.clear()
            if self.events is not None:
                self.events.record(AllBlocksCleared())
        return True

    def record_snapshot(self) -> None:
        """Record the whole map as one CacheSnapshot, after every event before it (the consumer's
        resync). Nothing without a queue, or with caching off (nothing is ever cached then)."""
        if self.events is not None and self.enable_caching:
            self.events.record(CacheSnapshot(self.cached_block_hashes()))

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every hash the cache holds now (O(cached blocks); the engine-loop thread, or a stopped engine)."""
        return list(self._cached)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks in use (0-1); cached free blocks count as free."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks

    def check_integrity(self) -> None:
        free = self.free_block_queue.get_all_free_blocks()
        free_ids = [block.block_id for block in free]
        assert len(free_ids) == len(set(free_ids)), "a block is twice in the free queue"
        assert len(free) == self.free_block_queue.num_free_blocks, (
            f"free queue holds {len(free)} blocks but counts {self.free_block_queue.num_free_blocks}")
        # The backward links must agree with the forward ones.
        prev = self.free_block_queue._head
        for block in free:
            assert block.prev_free is prev, f"broken back link at block {block.block_id}"
            prev = block
        assert self.free_block_queue._tail.prev_free is prev, "broken back link at the tail"
        assert all(block.ref_cnt >= 0 for block in self.blocks), "negative ref count"
        zero_ref = {block.block_id for block in self.blocks if block.ref_cnt == 0}
        assert set(free_ids) == zero_ref, (
            f"free queue {sorted(free_ids)} != blocks with ref_cnt 0 {sorted(zero_ref)}")
        for block in self.blocks:
            if block.ref_cnt > 0:
                assert block.prev_free is None and block.next_free is None, (
                    f"block {block.block_id} in use but linked into the free queue")
        num_used = sum(1 for block in self.blocks if block.ref_cnt > 0)
        assert len(free) + num_used == self.num_blocks, "free + used != total"
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, f"map entry for another hash at block {block.block_id}"
        hashed = [block for block in self.blocks if block.block_hash is not None]
        assert len(hashed) == len(self._cached), "a block carries a hash the cached map does not know"
        if not self.enable_caching:
            assert not self._cached, "caching is off but something was cached"
            assert self.events is None or not self.events, "caching is off but events were recorded"

    def _emit_stored(
        self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], start: int, end: int
    ) -> None:
        if self.events is None:
            return
        size = self.block_size
        self.events.record(BlockStored(
            block_hashes=list(block_hashes[start:end]),
            parent_block_hash=block_hashes[start - 1] if start > 0 else None,
            token_ids=list(token_ids[start * size : end * size]),
            block_size=size,
        ))
