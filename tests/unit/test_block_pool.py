"""Block pool and free queue: exact block ids, ref counts, queue order and events after scripted calls."""

from __future__ import annotations

import random

import pytest

from services.common.hashing import hash_token_blocks
from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, CacheSnapshot, KVCacheEvent
from services.engine.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from services.engine.kv_event_queue import KVEventQueue

BLOCK_SIZE = 4


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]


def queue_ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [block.block_id for block in queue.get_all_free_blocks()]


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def take(pool: BlockPool) -> list[KVCacheEvent]:
    assert pool.events is not None
    batch = pool.events.take()
    assert not batch.resync
    return batch.events


# ---------------------------------------------------------------------------------------------
# FreeKVCacheBlockQueue


def test_queue_keeps_insertion_order_and_counts():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 5
    assert queue_ids(queue) == [0, 1, 2, 3, 4]


def test_queue_remove_from_middle_head_and_tail():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue_ids(queue) == [0, 1, 3, 4]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert queue_ids(queue) == [1, 3]
    assert queue.num_free_blocks == 2


def test_queue_remove_of_a_block_not_in_it_raises():
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[1])
    with pytest.raises(ValueError):
        queue.remove(blocks[1])
    assert queue_ids(queue) == [0, 2]


def test_queue_popleft_append_appendleft():
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.popleft() is blocks[0]
    assert queue.popleft() is blocks[1]
    queue.append(blocks[0])
    queue.appendleft(blocks[1])
    assert queue_ids(queue) == [1, 2, 3, 0]
    assert queue.num_free_blocks == 4


def test_queue_popleft_n():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    popped = queue.popleft_n(4)
    assert ids(popped) == [0, 1, 2, 3]
    assert all(b.prev_free is None and b.next_free is None for b in popped)
    assert queue_ids(queue) == [4, 5]
    assert queue.num_free_blocks == 2
    assert queue.popleft_n(0) == []
    assert ids(queue.popleft_n(2)) == [4, 5]
    assert queue_ids(queue) == []
    # The emptied queue still works.
    queue.append(blocks[3])
    assert queue_ids(queue) == [3]


def test_queue_empty_pops_raise():
    queue = FreeKVCacheBlockQueue([])
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft_n(1)


def test_queue_random_ops_match_a_list_model():
    rng = random.Random(0)
    blocks = [KVCacheBlock(i) for i in range(20)]
    queue = FreeKVCacheBlockQueue(blocks)
    model = list(range(20))
    for _ in range(2000):
        op = rng.randrange(5)
        if op == 0 and model:
            assert queue.popleft().block_id == model.pop(0)
        elif op == 1 and model:
            victim = rng.choice(model)
            queue.remove(blocks[victim])
            model = [i for i in model if i != victim]
        elif op == 2 and model:
            n = rng.randint(0, len(model))
            assert ids(queue.popleft_n(n)) == model[:n]
            model = model[n:]
        else:
            outside = [i for i in range(20) if i not in model]
            if outside:
                b = rng.choice(outside)
                if rng.random() < 0.5:
                    queue.append(blocks[b])
                    model.append(b)
                else:
                    queue.appendleft(blocks[b])
                    model.insert(0, b)
        assert queue_ids(queue) == model
        assert queue.num_free_blocks == len(model)


# ---------------------------------------------------------------------------------------------
# BlockPool


def test_get_new_blocks_pops_from_the_front_with_ref_cnt_one():
    pool = BlockPool(10, BLOCK_SIZE)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.get_num_free_blocks() == 7
    assert free_ids(pool) == [3, 4, 5, 6, 7, 8, 9]
    assert pool.get_usage() == pytest.approx(0.3)
    pool.check_integrity()


def test_get_new_blocks_raises_when_short_and_changes_nothing():
    pool = BlockPool(4, BLOCK_SIZE)
    pool.get_new_blocks(3)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert free_ids(pool) == [3]
    pool.check_integrity()


def test_free_blocks_puts_cached_at_tail_and_unhashed_at_head():
    pool = BlockPool(10, BLOCK_SIZE)
    blocks = pool.get_new_blocks(3)
    tokens = list(range(10))
    hashes = hash_token_blocks(tokens, BLOCK_SIZE)
    pool.cache_full_blocks(blocks, hashes, 0, 2, tokens)
    pool.free_blocks(reversed(blocks))  # tail first, as the manager does
    # Unhashed block 2 is reused first; cached 1 evicted before cached 0.
    assert free_ids(pool) == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]
    assert [b.ref_cnt for b in blocks] == [0, 0, 0]
    pool.check_integrity()


def test_cache_full_blocks_sets_hashes_and_emits_one_stored_event_with_parent():
    pool = BlockPool(10, BLOCK_SIZE, events=KVEventQueue())
    blocks = pool.get_new_blocks(3)
    tokens = list(range(100, 112))
    hashes = hash_token_blocks(tokens, BLOCK_SIZE)
    pool.cache_full_blocks(blocks, hashes, 0, 1, tokens)
    pool.cache_full_blocks(blocks, hashes, 1, 3, tokens)
    assert [b.block_hash for b in blocks] == hashes
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.get_cached_block(hashes[2]) is blocks[2]
    assert take(pool) == [
        BlockStored([hashes[0]], None, [100, 101, 102, 103], BLOCK_SIZE),
        BlockStored([hashes[1], hashes[2]], hashes[0], list(range(104, 112)), BLOCK_SIZE),
    ]
    assert take(pool) == []  # drained
    pool.check_integrity()


def test_duplicate_content_keeps_the_existing_entry_and_stays_unhashed():
    pool = BlockPool(10, BLOCK_SIZE, events=KVEventQueue())
    tokens = list(range(8))
    hashes = hash_token_blocks(tokens, BLOCK_SIZE)
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, hashes, 0, 2, tokens)
    take(pool)
    pool.cache_full_blocks(b, hashes, 0, 2, tokens)
    assert pool.get_cached_block(hashes[0]) is a[0]
    assert pool.get_cached_block(hashes[1]) is a[1]
    assert [blk.block_hash for blk in b] == [None, None]
    assert take(pool) == []  # nothing new entered the cache
    pool.check_integrity()
    # Freed, the duplicates go to the head (reused first), the originals to the tail.
    pool.free_blocks(reversed(b))
    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]
    pool.check_integrity()


def test_duplicate_prefix_then_new_blocks_emit_one_event_for_the_new_run():
    pool = BlockPool(10, BLOCK_SIZE, events=KVEventQueue())
    tokens = list(range(12))
    hashes = hash_token_blocks(tokens, BLOCK_SIZE)
    a = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, hashes, 0, 1, tokens)
    take(pool)
    b = pool.get_new_blocks(3)
    pool.cache_full_blocks(b, hashes, 0, 3, tokens)
    assert [blk.block_hash for blk in b] == [None, hashes[1], hashes[2]]
    assert take(pool) == [BlockStored(hashes[1:3], hashes[0], list(range(4, 12)), BLOCK_SIZE)]
    pool.check_integrity()


def test_touch_revives_a_cached_free_block_out_of_the_middle_of_the_queue():
    pool = BlockPool(6, BLOCK_SIZE)
    blocks = pool.get_new_blocks(3)
    tokens = list(range(12))
    hashes = hash_token_blocks(tokens, BLOCK_SIZE)
    pool.cache_full_blocks(blocks, hashes, 0, 3, tokens)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 5, 2, 1, 0]
    pool.touch([blocks[0], blocks[1]])
    assert [b.ref_cnt for b in blocks] == [1, 1, 0]
    assert free_ids(pool) == [3, 4, 5, 2]
    # A second toucher only bumps the count.
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 2
    pool.check_integrity()
    pool.free_blocks([blocks[1], blocks[0], blocks[0]])
    assert free_ids(pool) == [3, 4, 5, 2, 1, 0]
    pool.check_integrity()


def test_eviction_emits_block_removed_with_the_evicted_hashes_in_order():
    pool = BlockPool(4, BLOCK_SIZE, events=KVEventQueue())
    blocks = pool.get_new_blocks(3)
    tokens = list(range(12))
    hashes = hash_token_blocks(tokens, BLOCK_SIZE)
    pool.cache_full_blocks(blocks, hashes, 0, 3, tokens)
    pool.free_blocks(reversed(blocks))
    take(pool)
    assert free_ids(pool) == [3, 2, 1, 0]
    first = pool.get_new_blocks(1)  # unhashed block 3: nothing evicted
    assert ids(first) == [3]
    assert take(pool) == []
    second = pool.get_new_blocks(2)  # the request's last blocks go first
    assert ids(second) == [2, 1]
    assert take(pool) == [BlockRemoved([hashes[2], hashes[1]])]
    assert [b.block_hash for b in second] == [None, None]
    assert pool.get_cached_block(hashes[2]) is None
    assert pool.get_cached_block(hashes[1]) is None
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    pool.check_integrity()


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    pool = BlockPool(4, BLOCK_SIZE, events=KVEventQueue())
    blocks = pool.get_new_blocks(2)
    tokens = list(range(8))
    hashes = hash_token_blocks(tokens, BLOCK_SIZE)
    pool.cache_full_blocks(blocks, hashes, 0, 2, tokens)
    take(pool)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert take(pool) == []
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(hashes[0]) is None
    assert all(b.block_hash is None for b in pool.blocks)
    assert take(pool) == [AllBlocksCleared()]
    # Reusing a block after the reset evicts nothing.
    pool.get_new_blocks(4)
    assert take(pool) == []
    pool.check_integrity()


def test_caching_disabled_never_hashes_nor_emits():
    pool = BlockPool(4, BLOCK_SIZE, events=KVEventQueue(), enable_caching=False)
    blocks = pool.get_new_blocks(2)
    tokens = list(range(8))
    hashes = hash_token_blocks(tokens, BLOCK_SIZE)
    pool.cache_full_blocks(blocks, hashes, 0, 2, tokens)
    assert [b.block_hash for b in blocks] == [None, None]
    assert pool.get_cached_block(hashes[0]) is None
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [0, 1, 2, 3]
    assert pool.reset_prefix_cache() is True
    assert take(pool) == []
    pool.check_integrity()


def test_no_consumer_no_events_kept():
    """An engine nobody listens to keeps no events, however long it runs (it once leaked them)."""
    pool = BlockPool(8, BLOCK_SIZE)
    for step in range(2000):
        tokens = list(range(step, step + 12))
        blocks = pool.get_new_blocks(3)
        pool.cache_full_blocks(blocks, hash_token_blocks(tokens, BLOCK_SIZE), 0, 3, tokens)
        pool.free_blocks(reversed(blocks))
        if step % 500 == 0:
            assert pool.reset_prefix_cache()
    assert pool.events is None and not hasattr(pool, "_events")
    assert len(pool._cached) == 8  # the cache itself still works
    pool.check_integrity()


def test_a_consumer_that_falls_behind_gets_all_cleared_and_a_resync():
    queue = KVEventQueue(max_events=4)
    pool = BlockPool(4, BLOCK_SIZE, events=queue)
    hashes = []
    for step in range(3):  # each step caches one block and evicts the previous step's
        tokens = list(range(step * 10, step * 10 + 4))
        hashes.append(hash_token_blocks(tokens, BLOCK_SIZE)[0])
        blocks = pool.get_new_blocks(4)
        pool.cache_full_blocks(blocks, hashes[-1:], 0, 1, tokens)
        pool.free_blocks(reversed(blocks))
        if step == 1:
            assert len(queue) == 3 and queue.num_overflows == 0  # stored 0, removed 0, stored 1
    # Step 2's removed 1 filled the queue; its stored 2 made it collapse, then was recorded.
    assert len(queue) == 2 and queue.num_overflows == 1
    batch = queue.take()
    assert batch.resync
    assert batch.events == [AllBlocksCleared(), BlockStored([hashes[2]], None, [20, 21, 22, 23], BLOCK_SIZE)]
    assert queue.take() == ([], False)  # the flag is reported once
    pool.get_new_blocks(4)
    assert queue.take() == ([BlockRemoved([hashes[2]])], False)  # back to exact events
    assert queue.num_overflows == 1
    pool.check_integrity()


def test_a_snapshot_follows_the_events_before_it_and_names_every_cached_block():
    pool = BlockPool(4, BLOCK_SIZE, events=KVEventQueue())
    tokens = list(range(12))
    hashes = hash_token_blocks(tokens, BLOCK_SIZE)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, hashes, 0, 3, tokens)
    pool.free_blocks(reversed(blocks))
    pool.get_new_blocks(2)  # evicts the unhashed block 3 (nothing), then block 2 (hashes[2])
    pool.record_snapshot()
    assert take(pool) == [BlockStored(hashes, None, tokens, BLOCK_SIZE), BlockRemoved([hashes[2]]),
                          CacheSnapshot([hashes[0], hashes[1]])]
    pool.check_integrity()


def test_no_snapshot_without_a_queue_or_with_caching_off():
    BlockPool(4, BLOCK_SIZE).record_snapshot()
    pool = BlockPool(4, BLOCK_SIZE, events=KVEventQueue(), enable_caching=False)
    pool.record_snapshot()
    assert take(pool) == []
    pool.check_integrity()


def test_a_closed_queue_keeps_nothing():
    """A publisher that stopped for good (a newer incarnation took its id) closes its queue."""
    queue = KVEventQueue()
    pool = BlockPool(4, BLOCK_SIZE, events=queue)
    pool.get_new_blocks(1)
    pool.record_snapshot()
    assert len(queue) == 1
    queue.close()
    assert len(queue) == 0
    pool.record_snapshot()
    assert queue.take() == ([], False)


def test_event_queue_bound_is_checked():
    with pytest.raises(ValueError, match="at least 2"):
        KVEventQueue(max_events=1)


def test_check_integrity_catches_corruption():
    pool = BlockPool(4, BLOCK_SIZE)
    blocks = pool.get_new_blocks(2)
    blocks[0].ref_cnt = 0  # in use by the queue's account, free by its count
    with pytest.raises(AssertionError):
        pool.check_integrity()
    blocks[0].ref_cnt = 1
    pool.check_integrity()
    blocks[1].block_hash = b"x" * 32  # a hash the map does not know
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_block_repr_does_not_walk_the_queue():
    pool = BlockPool(1000, BLOCK_SIZE)
    assert len(repr(pool.blocks[500])) < 100
