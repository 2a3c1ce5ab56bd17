"""KV-cache manager: prefix hits, allocation, caching and freeing, pinned to exact block ids, ref counts,
free-queue order and events; then random allocate/append/free sequences with integrity checked each step."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from services.common.clients import WorkerInfo
from services.common.config import SchedulerConfig
from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from services.common.sampling_params import SamplingParams
from services.engine.engine_core import EngineCore
from services.engine.block_pool import KVCacheBlock
from services.engine.kv_cache_manager import KVCacheManager
from services.engine.kv_event_queue import KVEventQueue
from services.engine.request import Request

B = 4  # block size


def make_request(request_id: str, prompt: list[int], block_size: int = B, **kwargs) -> Request:
    return Request(request_id, prompt, SamplingParams(), max_tokens=16, block_size=block_size, **kwargs)


def free_ids(manager: KVCacheManager) -> list[int]:
    return [block.block_id for block in manager.block_pool.free_block_queue.get_all_free_blocks()]


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def ref_cnts(manager: KVCacheManager) -> list[int]:
    return [block.ref_cnt for block in manager.block_pool.blocks]


def take(manager: KVCacheManager) -> list[KVCacheEvent]:
    queue = manager.block_pool.events
    assert queue is not None
    batch = queue.take()
    assert not batch.resync
    return batch.events


def admit(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None):
    """What the scheduler does for a waiting request: look up hits, allocate, advance the count."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit_tokens
    new_blocks = manager.allocate_slots(request, num_new_tokens, hits, num_hit_tokens)
    if new_blocks is not None:
        request.num_computed_tokens = num_hit_tokens + num_new_tokens
    manager.check_integrity()
    return hits, num_hit_tokens, new_blocks


def decode(manager: KVCacheManager, request: Request, token: int) -> list[KVCacheBlock] | None:
    """One decode step: the sampled token is appended, then its KV is scheduled."""
    request.append_output_token_ids([token])
    new_blocks = manager.allocate_slots(request, 1)
    if new_blocks is not None:
        request.num_computed_tokens += 1
    manager.check_integrity()
    return new_blocks


# ---------------------------------------------------------------------------------------------
# Scripted scenarios


def test_allocate_free_then_prefix_hit():
    manager = KVCacheManager(10, B, kv_events=KVEventQueue())
    a = make_request("a", list(range(10)))
    hits, num_hit_tokens, new_blocks = admit(manager, a)
    assert (hits, num_hit_tokens) == ([], 0)
    assert ids(new_blocks) == [0, 1, 2]
    assert manager.get_block_ids("a") == [0, 1, 2]
    assert ref_cnts(manager)[:3] == [1, 1, 1]
    h = a.block_hashes
    assert [b.block_hash for b in manager.get_blocks("a")] == [h[0], h[1], None]
    assert take(manager) == [BlockStored([h[0], h[1]], None, list(range(8)), B)]

    manager.free(a)
    manager.check_integrity()
    # The partial block 2 at the head, cached blocks at the tail, a's last block evicted first.
    assert free_ids(manager) == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]
    assert manager.usage == 0.0

    b = make_request("b", list(range(8)) + [50, 51])
    hits, num_hit_tokens, new_blocks = admit(manager, b)
    assert ids(hits) == [0, 1]
    assert num_hit_tokens == 8
    assert ids(new_blocks) == [2]
    assert manager.get_block_ids("b") == [0, 1, 2]
    assert ref_cnts(manager)[:3] == [1, 1, 1]
    assert free_ids(manager) == [3, 4, 5, 6, 7, 8, 9]
    assert b.num_computed_tokens == 10
    assert take(manager) == []  # the hits were cached already; block 2 is partial


def test_two_live_requests_share_hit_blocks():
    manager = KVCacheManager(10, B)
    a = make_request("a", list(range(12)) + [99])
    admit(manager, a)
    assert manager.get_block_ids("a") == [0, 1, 2, 3]
    b = make_request("b", list(range(8)) + [7, 7, 7])
    hits, num_hit_tokens, new_blocks = admit(manager, b)
    assert ids(hits) == [0, 1]
    assert ids(new_blocks) == [4]
    assert ref_cnts(manager)[:5] == [2, 2, 1, 1, 1]
    manager.free(a)
    manager.check_integrity()
    assert ref_cnts(manager)[:5] == [1, 1, 0, 0, 1]
    # a's own blocks freed tail first: partial 3 to the head, cached 2 to the tail.
    assert free_ids(manager) == [3, 5, 6, 7, 8, 9, 2]
    manager.free(b)
    assert free_ids(manager) == [4, 3, 5, 6, 7, 8, 9, 2, 1, 0]
    manager.check_integrity()


@pytest.mark.parametrize(("prompt_len", "expected_hit_blocks"), [(7, 1), (8, 1), (9, 2), (12, 2), (13, 3)])
def test_never_the_whole_prompt(prompt_len, expected_hit_blocks):
    manager = KVCacheManager(10, B)
    a = make_request("a", list(range(prompt_len)))
    admit(manager, a)
    manager.free(a)
    b = make_request("b", list(range(prompt_len)))
    hits, num_hit_tokens, new_blocks = admit(manager, b)
    assert len(hits) == expected_hit_blocks
    assert num_hit_tokens == expected_hit_blocks * B
    assert num_hit_tokens <= prompt_len - 1
    assert b.num_computed_tokens == prompt_len


def test_exact_multiple_prompt_recomputes_the_last_block_into_a_fresh_one():
    manager = KVCacheManager(10, B, kv_events=KVEventQueue())
    a = make_request("a", list(range(8)))
    admit(manager, a)
    assert take(manager) == [BlockStored(a.block_hashes, None, list(range(8)), B)]
    manager.free(a)
    assert free_ids(manager) == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]
    b = make_request("b", list(range(8)))
    hits, num_hit_tokens, new_blocks = admit(manager, b)
    assert ids(hits) == [0]
    assert num_hit_tokens == 4
    assert ids(new_blocks) == [2]
    # Block 2 computes the same content as cached block 1: the existing entry is kept, 2 stays unhashed.
    assert manager.block_pool.get_cached_block(b.block_hashes[1]).block_id == 1
    assert manager.get_blocks("b")[1].block_hash is None
    assert take(manager) == []
    manager.free(b)
    assert free_ids(manager) == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]
    manager.check_integrity()


def test_eviction_order_and_removed_events():
    manager = KVCacheManager(4, B, kv_events=KVEventQueue())
    a = make_request("a", list(range(13)))  # blocks 0-2 full, 3 partial
    admit(manager, a)
    h = a.block_hashes
    take(manager)
    manager.free(a)
    assert free_ids(manager) == [3, 2, 1, 0]
    c = make_request("c", [100, 101, 102, 103, 104])  # needs 2 blocks: 3 (unhashed) then 2 (evicted)
    _, _, new_blocks = admit(manager, c)
    assert ids(new_blocks) == [3, 2]
    assert take(manager) == [
        BlockRemoved([h[2]]),
        BlockStored(c.block_hashes, None, [100, 101, 102, 103], B),
    ]
    # a's prefix minus its evicted tail still hits.
    a2 = make_request("a2", list(range(13)))
    hits, num_hit_tokens, _ = admit(manager, a2, num_new_tokens=1)
    assert ids(hits) == [0, 1]
    assert num_hit_tokens == 8
    manager.check_integrity()


def test_stored_events_follow_decode_with_the_right_parent():
    manager = KVCacheManager(10, B, kv_events=KVEventQueue())
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    admit(manager, a)
    h0 = a.block_hashes[0]
    assert take(manager) == [BlockStored([h0], None, [1, 2, 3, 4], B)]
    assert decode(manager, a, 7) == []  # token 7 fits block 1
    assert take(manager) == []
    assert decode(manager, a, 8) == []  # block 1 is now full and final
    assert take(manager) == [BlockStored([a.block_hashes[1]], h0, [5, 6, 7, 8], B)]
    assert ids(decode(manager, a, 9)) == [2]
    assert take(manager) == []
    assert manager.get_block_ids("a") == [0, 1, 2]


def test_chunked_prefill_caches_each_chunk_and_continues_the_chain():
    manager = KVCacheManager(10, B, kv_events=KVEventQueue())
    a = make_request("a", list(range(10)))
    _, _, new_blocks = admit(manager, a, num_new_tokens=5)
    assert ids(new_blocks) == [0, 1]
    assert a.num_computed_tokens == 5
    assert take(manager) == [BlockStored(a.block_hashes[:1], None, [0, 1, 2, 3], B)]
    assert ids(manager.allocate_slots(a, 5)) == [2]
    a.num_computed_tokens += 5
    assert take(manager) == [BlockStored(a.block_hashes[1:2], a.block_hashes[0], [4, 5, 6, 7], B)]
    manager.check_integrity()


def test_hit_then_chunk_caches_after_the_hits_with_their_parent():
    manager = KVCacheManager(10, B, kv_events=KVEventQueue())
    a = make_request("a", list(range(9)))
    admit(manager, a)
    manager.free(a)
    take(manager)
    b = make_request("b", list(range(16)) + [1])
    hits, num_hit_tokens, new_blocks = admit(manager, b, num_new_tokens=5)
    assert ids(hits) == [0, 1]
    assert ids(new_blocks) == [2, 3]
    assert b.num_computed_tokens == 13
    assert take(manager) == [BlockStored(b.block_hashes[2:3], b.block_hashes[1], [8, 9, 10, 11], B)]


def test_allocate_slots_none_changes_nothing():
    manager = KVCacheManager(4, B, kv_events=KVEventQueue())
    a = make_request("a", list(range(9)))
    admit(manager, a)  # blocks 0, 1 cached, 2 partial
    manager.free(a)
    take(manager)
    assert free_ids(manager) == [2, 3, 1, 0]
    # 17 tokens = 5 blocks, more than the pool: 2 hits (both free) + 3 new > 4 free.
    b = make_request("b", list(range(17)))
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert ids(hits) == [0, 1]
    assert manager.allocate_slots(b, 9, hits, num_hit_tokens) is None
    # 16 tokens: 2 hits + 2 new = the whole pool; without discounting the free hits it looks like 3
    # free blocks to spare, and would hand the hits out twice.
    c = make_request("c", list(range(8)) + [5] * 8)
    hits, num_hit_tokens = manager.get_computed_blocks(c)
    assert manager.allocate_slots(c, 9, hits, num_hit_tokens) is None

    assert free_ids(manager) == [2, 3, 1, 0]
    assert ref_cnts(manager) == [0, 0, 0, 0]
    assert manager.get_block_ids("b") == [] and manager.get_block_ids("c") == []
    assert "b" not in manager.req_to_blocks and "c" not in manager.num_cached_blocks
    assert take(manager) == []
    manager.check_integrity()

    # One token fewer fits exactly.
    d = make_request("d", list(range(8)) + [5] * 7)
    _, _, new_blocks = admit(manager, d)
    assert ids(new_blocks) == [2, 3]
    assert manager.num_free_blocks == 0
    assert manager.usage == 1.0


def test_allocate_slots_none_for_a_running_request_changes_nothing():
    manager = KVCacheManager(3, B, kv_events=KVEventQueue())
    a = make_request("a", list(range(8)))
    admit(manager, a)
    b = make_request("b", [9])
    admit(manager, b)
    take(manager)
    def state():
        return (free_ids(manager), ref_cnts(manager), manager.get_block_ids("a"),
                dict(manager.num_cached_blocks))

    before = state()
    assert decode(manager, a, 1) is None  # needs a third block
    assert state() == before
    assert take(manager) == []


def test_cache_salt_and_model_id_do_not_share_blocks():
    manager = KVCacheManager(20, B)
    prompt = list(range(9))
    a = make_request("a", prompt, model_id="m1")
    admit(manager, a)
    manager.free(a)
    for request in (
        make_request("other-model", prompt, model_id="m2"),
        make_request("salted", prompt, model_id="m1", cache_salt="tenant-1"),
    ):
        hits, num_hit_tokens = manager.get_computed_blocks(request)
        assert (hits, num_hit_tokens) == ([], 0)
    same = make_request("same", prompt, model_id="m1")
    hits, num_hit_tokens = manager.get_computed_blocks(same)
    assert ids(hits) == [0, 1]
    # The same salt does share.
    s1 = make_request("s1", prompt, model_id="m1", cache_salt="tenant-1")
    admit(manager, s1)
    assert manager.get_block_ids("s1") == [2, 3, 4]
    manager.free(s1)
    s2 = make_request("s2", prompt, model_id="m1", cache_salt="tenant-1")
    hits, _ = manager.get_computed_blocks(s2)
    assert ids(hits) == [2, 3]


def test_prefix_cache_stats_count_tokens():
    manager = KVCacheManager(10, B)
    a = make_request("a", list(range(10)))
    admit(manager, a)
    manager.free(a)
    b = make_request("b", list(range(10)))
    admit(manager, b)
    assert manager.prefix_cache_queries == 20
    assert manager.prefix_cache_hits == 8


def test_caching_disabled():
    manager = KVCacheManager(10, B, kv_events=KVEventQueue(), enable_caching=False)
    a = make_request("a", list(range(10)))
    admit(manager, a)
    manager.free(a)
    assert free_ids(manager) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    b = make_request("b", list(range(10)))
    hits, num_hit_tokens, new_blocks = admit(manager, b)
    assert (hits, num_hit_tokens) == ([], 0)
    assert ids(new_blocks) == [0, 1, 2]
    assert all(block.block_hash is None for block in manager.block_pool.blocks)
    assert take(manager) == []
    assert manager.prefix_cache_queries == 0 and manager.prefix_cache_hits == 0


def test_reset_prefix_cache():
    manager = KVCacheManager(10, B, kv_events=KVEventQueue())
    a = make_request("a", list(range(10)))
    admit(manager, a)
    take(manager)
    assert manager.reset_prefix_cache() is False
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert take(manager) == [AllBlocksCleared()]
    b = make_request("b", list(range(10)))
    hits, num_hit_tokens, new_blocks = admit(manager, b)
    assert (hits, num_hit_tokens) == ([], 0)
    assert ids(new_blocks) == [2, 3, 4]


def test_without_a_consumer_nothing_is_recorded():
    """The default engine attaches no queue: many requests later, the pool holds no events."""
    manager = KVCacheManager(16, B)
    for i in range(500):
        request = make_request(f"r{i}", [i % 7] * 9 + [i])
        admit(manager, request)
        decode(manager, request, i)
        manager.free(request)
    assert manager.block_pool.events is None
    assert manager.prefix_cache_hits > 0  # the prefix cache kept working
    manager.check_integrity()


def test_engine_core_passes_its_queue_through():
    info = WorkerInfo("m", "/m", 100, 64, B)
    plain = EngineCore(None, info, 16, SchedulerConfig())
    assert plain.kv_cache_manager.block_pool.events is None  # an engine without --prefix-index
    queue = KVEventQueue()
    core = EngineCore(None, info, 16, SchedulerConfig(), kv_events=queue)
    assert core.kv_cache_manager.block_pool.events is queue


def test_preempted_request_resumes_from_its_own_cached_blocks():
    manager = KVCacheManager(10, B)
    a = make_request("a", list(range(6)))
    admit(manager, a)
    for token in (6, 7, 8):
        decode(manager, a, token)
    assert manager.get_block_ids("a") == [0, 1, 2]
    manager.free(a)  # preempted: recompute prompt + outputs
    a.num_computed_tokens = 0
    hits, num_hit_tokens, new_blocks = admit(manager, a)
    assert ids(hits) == [0, 1]
    assert num_hit_tokens == 8
    assert ids(new_blocks) == [2]
    assert a.num_computed_tokens == 9


def test_free_is_idempotent_and_unknown_ids_are_empty():
    manager = KVCacheManager(4, B)
    a = make_request("a", [1, 2, 3])
    admit(manager, a)
    manager.free(a)
    manager.free(a)
    manager.free(make_request("never", [1]))
    assert manager.get_block_ids("a") == []
    assert manager.get_blocks("never") == []
    assert manager.num_free_blocks == 4
    manager.check_integrity()


def test_bad_arguments_raise():
    manager = KVCacheManager(10, B)
    a = make_request("a", list(range(9)))
    admit(manager, a)
    manager.free(a)
    b = make_request("b", list(range(9)))
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    with pytest.raises(ValueError):
        manager.allocate_slots(b, 1, hits, num_hit_tokens - 1)
    with pytest.raises(ValueError):
        manager.allocate_slots(b, -1)
    manager.check_integrity()


# ---------------------------------------------------------------------------------------------
# Random sequences: a fake worker writes each scheduled token into its slot, so a prefix hit can be
# checked against what was really written there; the events must mirror the cached map exactly.


class KVCacheMachine(RuleBasedStateMachine):
    PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5]]

    @initialize(num_blocks=st.integers(3, 24), block_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_blocks, block_size):
        self.manager = KVCacheManager(num_blocks, block_size, kv_events=KVEventQueue())
        self.block_size = block_size
        self.running: dict[str, Request] = {}
        self.next_id = 0
        # block id -> (cache key, block index, token per slot) as written by the fake worker
        self.content: dict[int, tuple[tuple, int, list[int | None]]] = {}
        self.index: set[bytes] = set()  # a prefix index fed only from events

    def _write(self, request: Request, start: int, end: int, new_blocks: list[KVCacheBlock]) -> None:
        key = (request._model_id, request._cache_salt)
        blocks = self.manager.get_blocks(request.request_id)
        for block in new_blocks:
            self.content[block.block_id] = (key, blocks.index(block), [None] * self.block_size)
        for pos in range(start, end):
            block = blocks[pos // self.block_size]
            assert block.ref_cnt == 1, "writing into a shared block"
            block_key, block_index, slots = self.content[block.block_id]
            assert (block_key, block_index) == (key, pos // self.block_size)
            slots[pos % self.block_size] = request.all_token_ids[pos]

    def _schedule(self, request: Request, num_new_tokens: int, token: int, hits=(), num_hit_tokens=0) -> bool:
        start = request.num_computed_tokens + num_hit_tokens
        new_blocks = self.manager.allocate_slots(request, num_new_tokens, hits, num_hit_tokens)
        if new_blocks is None:
            return False
        request.num_computed_tokens = start + num_new_tokens
        self._write(request, start, request.num_computed_tokens, new_blocks)
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token_ids([token])
        return True

    @rule(prefix=st.sampled_from(range(3)), cut=st.integers(0, 12),
          tail=st.lists(st.integers(0, 3), max_size=6), model=st.sampled_from(["m1", "m2"]),
          salt=st.sampled_from([None, None, "s"]), chunk=st.integers(1, 16), token=st.integers(0, 3))
    def add_request(self, prefix, cut, tail, model, salt, chunk, token):
        prompt = self.PREFIXES[prefix][:cut] + tail or [0]
        request = make_request(f"r{self.next_id}", prompt, self.block_size, model_id=model, cache_salt=salt)
        self.next_id += 1
        hits, num_hit_tokens = self.manager.get_computed_blocks(request)
        assert num_hit_tokens <= request.num_tokens - 1
        for i, block in enumerate(hits):
            block_key, block_index, slots = self.content[block.block_id]
            assert block_key == (model, salt) and block_index == i
            assert slots == request.all_token_ids[i * self.block_size : (i + 1) * self.block_size]
        before = (ref_cnts(self.manager), free_ids(self.manager))
        num_new_tokens = min(chunk, request.num_tokens - num_hit_tokens)
        if self._schedule(request, num_new_tokens, token, hits, num_hit_tokens):
            self.running[request.request_id] = request
        else:
            assert (ref_cnts(self.manager), free_ids(self.manager)) == before
            assert request.request_id not in self.manager.req_to_blocks

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 1000), chunk=st.integers(1, 8), token=st.integers(0, 3))
    def step(self, pick, chunk, token):
        request = list(self.running.values())[pick % len(self.running)]
        num_new_tokens = min(chunk, request.num_tokens - request.num_computed_tokens)
        scheduled = self._schedule(request, num_new_tokens, token)
        if not scheduled or request.num_output_tokens >= request.max_tokens:
            # Out of blocks (preempt) or done: either way its blocks go back.
            self.manager.free(self.running.pop(request.request_id))

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 1000))
    def finish(self, pick):
        request = list(self.running.values())[pick % len(self.running)]
        self.manager.free(self.running.pop(request.request_id))

    @rule()
    def reset_prefix_cache(self):
        in_use = any(self.manager.get_blocks(request_id) for request_id in self.running)
        assert self.manager.reset_prefix_cache() is not in_use

    @invariant()
    def integrity(self):
        if not hasattr(self, "manager"):
            return
        self.manager.check_integrity()
        for event in take(self.manager):
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                assert not self.index & set(event.block_hashes)
                self.index |= set(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.index
                self.index -= set(event.block_hashes)
            else:
                self.index.clear()
        pool = self.manager.block_pool
        assert self.index == {block.block_hash for block in pool.blocks if block.block_hash is not None}
        used = {block.block_id for r in self.running for block in self.manager.get_blocks(r)}
        assert self.manager.num_free_blocks == pool.num_blocks - len(used)

    def teardown(self):
        if not hasattr(self, "manager"):
            return
        for request in list(self.running.values()):
            self.manager.free(request)
        self.manager.check_integrity()
        assert self.manager.usage == 0.0
        assert self.manager.num_free_blocks == self.manager.block_pool.num_blocks
        assert all(block.ref_cnt == 0 for block in self.manager.block_pool.blocks)


KVCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
# Over a second: `make test`, not test-fast.
test_kv_cache_manager_state_machine = pytest.mark.slow(KVCacheMachine.TestCase)


def test_random_sequences_seeded():
    """A longer plain random run (reproducible by seed) over a tight pool."""
    rng = random.Random(1234)
    for _ in range(20):
        machine = KVCacheMachine()
        machine.setup(num_blocks=rng.randint(3, 12), block_size=rng.choice([1, 2, 4]))
        for _ in range(200):
            op = rng.random()
            if op < 0.35 or not machine.running:
                tail = [rng.randint(0, 3) for _ in range(rng.randint(0, 6))]
                machine.add_request(rng.randrange(3), rng.randint(0, 12), tail, rng.choice(["m1", "m2"]),
                                    rng.choice([None, "s"]), rng.randint(1, 16), rng.randint(0, 3))
            elif op < 0.9:
                machine.step(rng.randrange(1000), rng.randint(1, 8), rng.randint(0, 3))
            elif op < 0.98:
                machine.finish(rng.randrange(1000))
            else:
                machine.reset_prefix_cache()
            machine.integrity()
        machine.teardown()
