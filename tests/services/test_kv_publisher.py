"""The engine's prefix-index publisher against a real redis-server: what Redis says this engine holds
is exactly what its block pool caches, after evictions, a random workload, a queue overflow, a Redis
restart and a sweep; and the engine service publishes, names itself in GetInfo and clears itself at
SIGTERM.

The in-process tests drive an AsyncEngine over tests/unit/test_async_engine.py's scripted worker
(its block pool, scheduler and the publisher are the real ones; the model does not matter to what is
cached). Each compares once the engine is idle, when its pool does not change.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis.exceptions import ConnectionError as RedisConnectionError

from services.common.config import EngineServiceConfig, ModelConfig, SchedulerConfig, ServingConfig
from services.common.engine_output import EngineCoreRequest
from services.common.hashing import BlockHash, hash_token_blocks
from services.common.kv_events import CacheSnapshot
from services.common.metrics import ServiceMetrics
from services.common.sampling_params import SamplingParams
from services.engine.async_engine import AsyncEngine, EngineIdentity
from services.engine.client import GrpcEngineClient
from services.engine.kv_event_queue import KVEventQueue
from services.engine.kv_publisher import KVPublisher
from services.engine.metrics import EngineLabels, PublisherMetrics
from services.engine.server import EngineServiceArgs, engine_identity, start_engine
from services.prefix_index import RedisPrefixIndex
from tests.redis_server import RedisServer
from tests.services.procs import running_stack
from tests.unit.test_async_engine import ScriptedWorker, until

pytestmark = pytest.mark.anyio

ENGINE_ID = "127.0.0.1:7001"
BLOCK_SIZE = 4  # the scripted worker's


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


class Fleet:
    """One engine publishing into a namespace of its own, and ways to compare the two."""

    def __init__(self, engine: AsyncEngine, publisher: KVPublisher, registry: CollectorRegistry,
                 redis_url: str, namespace: str) -> None:
        self.engine, self.publisher, self.registry, self.namespace = engine, publisher, registry, namespace
        self.reader = RedisPrefixIndex.connect(redis_url, 1.0, namespace)  # as a router reads it
        self.client = aioredis.Redis.from_url(redis_url)

    def pool(self) -> set[BlockHash]:
        return set(self.engine.core.kv_cache_manager.block_pool.cached_block_hashes())

    async def indexed(self) -> set[BlockHash]:
        """The engine's reverse set in Redis: what the index says it holds."""
        engine_id, _ = self.engine.identity
        if (await self.reader.engines()).get(engine_id, None) is None:
            return set()
        return await self.client.smembers(f"{self.namespace}:e:{engine_id}:blocks")

    async def check_forward_keys(self, held: set[BlockHash]) -> None:
        """The forward keys say what the reverse set says (docs/features/prefix_index.md's invariant, as the
        router reads it). Only once the publisher is quiet: it updates both between our reads."""
        engine_id, epoch = self.engine.identity
        member = f"{engine_id}:{epoch}".encode()
        for block_hash in held:
            assert member in await self.client.smembers(f"{self.namespace}:b:".encode() + block_hash)

    async def wait_until_agreed(self, timeout: float = 10.0) -> set[BlockHash]:
        """Once idle, the index converges on the pool (the publisher polls every few ms)."""
        await until(lambda: self.idle(), timeout)
        try:
            await until(self._agrees, timeout)
        except TimeoutError:
            pool = self.pool()
            raise AssertionError(f"index {len(await self.indexed())} blocks != pool {len(pool)} blocks: "
                                 f"{len(await self.indexed() ^ pool)} differ") from None
        self.engine.core.check_integrity()
        held = self.pool()
        await self.check_forward_keys(held)
        return held

    async def _agrees(self) -> bool:
        """The pool read afresh each time: the engine loop may still be finishing its last step."""
        try:
            return await self.indexed() == self.pool()
        except (ConnectionError, RedisConnectionError):  # a restarted Redis: our connections were cut
            return False

    async def idle(self) -> bool:
        stats = await self.engine.stats()
        return stats.num_running == stats.num_waiting == 0 and not self.engine.core.has_finished_requests()

    def counter(self, name: str) -> float:
        value = self.registry.get_sample_value(f"kvmesh_engine_kv_{name}_total",
                                               {"component": "engine", "model_name": "m", "engine": "0"})
        return value or 0.0

    async def close(self) -> None:
        await self.publisher.close()
        await self.engine.shutdown()
        await self.reader.close()
        await self.client.aclose()


@pytest.fixture
async def start_fleet() -> AsyncIterator[Callable[..., Awaitable[Fleet]]]:
    """start_fleet(redis_url, ...) -> a Fleet, closed at the test's end whatever happened."""
    fleets: list[Fleet] = []

    async def start(*args, **kwargs) -> Fleet:
        fleets.append(await make_fleet(*args, **kwargs))
        return fleets[-1]

    yield start
    for fleet in fleets:
        await fleet.close()


async def make_fleet(redis_url: str, num_blocks: int = 32, heartbeat_ttl: float = 3.0, *,
                     max_events: int = 10_000, index_ttl: float | None = None, start: bool = True) -> Fleet:
    """`index_ttl`: the TTL Redis keeps the engine alive for, when it should differ from the one the
    publisher heartbeats by."""
    namespace = f"t{uuid.uuid4().hex[:8]}"
    engine = await AsyncEngine.create(ScriptedWorker(num_blocks), SchedulerConfig(max_num_batched_tokens=32,
                                                                                  max_num_seqs=8),
                                      kv_events=KVEventQueue(max_events), identity=EngineIdentity(ENGINE_ID, 5))
    index = RedisPrefixIndex.connect(redis_url, 0.3, namespace, index_ttl or heartbeat_ttl)
    registry = CollectorRegistry()
    publisher = KVPublisher(index, engine, heartbeat_ttl, PublisherMetrics(registry, EngineLabels("m")),
                            poll_interval=0.01)
    if start:
        publisher.start()
    return Fleet(engine, publisher, registry, redis_url, namespace)


def make_request(request_id: str, prompt: list[int], max_tokens: int = 3) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens),
                             eos_token_ids=(2,))


async def run(engine: AsyncEngine, request: EngineCoreRequest, stop_after: int | None = None) -> None:
    """The request to its end, or aborted (its stream closed) after `stop_after` outputs."""
    async with asyncio.timeout(30), aclosing(engine.generate(request)) as stream:
        seen = 0
        async for output in stream:
            seen += 1
            if output.finished or seen == stop_after:
                break


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(length)]


async def test_the_index_holds_exactly_the_pools_blocks_and_loses_the_evicted(redis_server, start_fleet):
    fleet = await start_fleet(redis_server.url, num_blocks=24)
    first = prompt(1, 30)  # 7 full blocks
    await run(fleet.engine, make_request("first", first))
    held = await fleet.wait_until_agreed()
    chain = hash_token_blocks(first, BLOCK_SIZE, "scripted")
    assert set(chain) <= held
    assert await fleet.reader.longest_prefix(chain) == {ENGINE_ID: 7}
    for i in range(2, 6):  # 4 more prompts of 8+ blocks each in a cache of 24: the first one is evicted
        await run(fleet.engine, make_request(f"next-{i}", prompt(i, 30)))
    held = await fleet.wait_until_agreed()
    assert chain[0] not in held
    assert await fleet.reader.longest_prefix(chain) == {}
    assert fleet.counter("events_published") > 0 and fleet.counter("publish_failures") == 0


async def test_a_random_workload_leaves_index_and_pool_in_exact_agreement(redis_server, start_fleet):
    """Shared prefixes, concurrent requests, aborts and evictions."""
    rng = random.Random(12)
    fleet = await start_fleet(redis_server.url, num_blocks=40)
    prefixes = [prompt(100 + i, rng.randrange(8, 24)) for i in range(4)]
    for wave in range(6):
        requests = []
        for i in range(6):
            tokens = rng.choice(prefixes) + prompt(rng.randrange(10**6), rng.randrange(1, 14))
            request = make_request(f"w{wave}-{i}", tokens, max_tokens=rng.randrange(1, 9))
            requests.append(run(fleet.engine, request, stop_after=rng.choice([None, None, 1, 2])))
        await asyncio.gather(*requests)
        if wave % 2:
            await fleet.wait_until_agreed()
    held = await fleet.wait_until_agreed()
    assert len(held) > 10  # something to agree on
    stats = await fleet.engine.stats()
    assert stats.num_used_blocks == 0


async def test_a_queue_overflow_is_followed_by_a_resync(redis_server, start_fleet):
    """Events recorded while nobody drains the queue overflow it: only a republish of the whole
    pool can bring the index back (the collapsed queue holds a few events after AllBlocksCleared)."""
    fleet = await start_fleet(redis_server.url, num_blocks=32, max_events=4, start=False)
    for i in range(6):
        await run(fleet.engine, make_request(f"r{i}", prompt(i, 21)))
    assert fleet.engine.core.kv_events.num_overflows > 0
    fleet.publisher.start()
    held = await fleet.wait_until_agreed()
    assert len(held) >= 5
    assert fleet.counter("event_queue_overflows") >= 1 and fleet.counter("resyncs") >= 1
    await run(fleet.engine, make_request("after", prompt(99, 21)))  # and it goes on with exact events
    await fleet.wait_until_agreed()


async def test_steps_go_on_while_redis_is_down_and_the_pool_is_republished_when_it_returns(start_fleet):
    server = RedisServer().start()
    fleet = await start_fleet(server.url, num_blocks=32, heartbeat_ttl=1.5)
    try:
        await run(fleet.engine, make_request("before", prompt(1, 21)))
        await fleet.wait_until_agreed()
        server.stop()
        for i in range(4):  # every request completes: publishing never holds a step
            await run(fleet.engine, make_request(f"during-{i}", prompt(10 + i, 21)))
        await until(lambda: fleet.counter("publish_failures") > 0, timeout=5)
        server.start()  # empty: everything the engine published is gone
        held = await fleet.wait_until_agreed()
        assert set(hash_token_blocks(prompt(13, 21), BLOCK_SIZE, "scripted")) <= held
        assert fleet.counter("resyncs") >= 1
    finally:
        server.close()


async def test_an_engine_swept_while_silent_republishes_when_it_speaks_again(redis_server, start_fleet):
    """Its heartbeat expired (the index's TTL is shorter than the publisher's heartbeat period here)
    and a sweep removed it; its next update finds the index ignorant of it and republishes."""
    fleet = await start_fleet(redis_server.url, heartbeat_ttl=60.0, index_ttl=0.5)
    first = prompt(1, 21)
    await run(fleet.engine, make_request("first", first))
    await fleet.wait_until_agreed()
    await asyncio.sleep(0.6)  # idle: nothing published, the heartbeat key expires
    assert await fleet.reader.sweep() == [ENGINE_ID]
    assert await fleet.indexed() == set()
    await run(fleet.engine, make_request("second", prompt(2, 21)))
    held = await fleet.wait_until_agreed()
    assert set(hash_token_blocks(first, BLOCK_SIZE, "scripted")) <= held  # swept, and republished


async def test_a_live_newer_incarnation_stands_publishing_down_and_keeps_its_entries(redis_server, start_fleet):
    fleet = await start_fleet(redis_server.url)
    await run(fleet.engine, make_request("old", prompt(1, 21)))
    await fleet.wait_until_agreed()
    newer = [hash_token_blocks(prompt(2, 8), BLOCK_SIZE, "scripted")[0]]
    # Restarted elsewhere, heartbeating by the same TTL (a longer one would look forged).
    incarnation = RedisPrefixIndex.connect(redis_server.url, 1.0, fleet.reader.namespace, 3.0)
    try:
        assert await incarnation.apply(ENGINE_ID, 6, [CacheSnapshot(newer)]) is False
    finally:
        await incarnation.close()
    await run(fleet.engine, make_request("late", prompt(3, 21)))  # its events meet the newer epoch
    await until(lambda: fleet.publisher.stale, timeout=5)
    await fleet.publisher.close()
    assert (await fleet.reader.engines())[ENGINE_ID].epoch == 6
    assert await fleet.reader.longest_prefix(newer) == {ENGINE_ID: 1}  # the close left them alone
    assert len(fleet.engine.core.kv_events) == 0  # and nothing piles up for a publisher that is gone


async def test_without_a_prefix_index_no_queue_is_attached_and_nothing_recorded():
    worker = ScriptedWorker()
    args = EngineServiceArgs(EngineServiceConfig(worker_address=("127.0.0.1:1",)), SchedulerConfig(), ModelConfig(),
                             ServingConfig())
    engine, publisher = await start_engine(worker, args, ServiceMetrics.create("engine"),
                                           EngineIdentity(ENGINE_ID, 9))
    try:
        assert publisher is None
        await run(engine, make_request("r", prompt(1, 21)))
        assert engine.core.kv_events is None and engine.core.kv_cache_manager.block_pool.events is None
        assert engine.core.kv_cache_manager.block_pool.cached_block_hashes()  # caching itself works
        info = await engine.info()
        assert (info.engine_id, info.epoch) == (ENGINE_ID, 9)
    finally:
        await engine.shutdown()


def test_the_engine_is_named_by_its_advertised_or_bound_address():
    before = time.time_ns()
    named = engine_identity(None, "127.0.0.1", 50052)
    assert named.engine_id == "127.0.0.1:50052" and before <= named.epoch <= time.time_ns()
    assert engine_identity("10.0.0.7:9000", "0.0.0.0", 50052).engine_id == "10.0.0.7:9000"
    everywhere = engine_identity(None, "0.0.0.0", 50052).engine_id  # this machine's address, never 0.0.0.0
    assert everywhere == f"{socket.gethostbyname(socket.gethostname())}:50052"
    assert engine_identity(None, "::1", 1).engine_id == "[::1]:1"


def test_the_engine_service_publishes_names_itself_and_clears_itself_at_sigterm(served_model: str,
                                                                                 redis_server: RedisServer):
    namespace = f"t{uuid.uuid4().hex[:8]}"
    tokens = prompt(7, 80)  # 5 blocks of 16
    with running_stack(worker=dict(model=served_model, dtype="float32", kv_cache_memory=32 * 2**20),
                       engine=dict(prefix_index=redis_server.url, prefix_index_namespace=namespace,
                                   heartbeat_ttl=3)) as (_, engine, _, _):

        async def main():
            client = GrpcEngineClient(engine.address, timeout=10)
            index = RedisPrefixIndex.connect(redis_server.url, 1.0, namespace)
            try:
                info = await client.info()
                await run_remote(client, make_request("r", tokens))
                chain = hash_token_blocks(tokens, info.block_size, info.model_id)
                await until(lambda: _equals(index.longest_prefix(chain), {info.engine_id: 5}), 15)
                engines = await index.engines()
                return info, engines
            finally:
                await client.close()
                await index.close()

        info, engines = asyncio.run(main())
        assert info.engine_id == engine.address
        assert abs(info.epoch - time.time_ns()) < 300 * 10**9  # its start time, in ns
        assert engines[info.engine_id].epoch == info.epoch and engines[info.engine_id].load is not None
        assert engine.terminate(timeout=15) == 0, engine.log()
        assert asyncio.run(_keys(redis_server, namespace)) == []  # cleared itself: nothing left


async def run_remote(client: GrpcEngineClient, request: EngineCoreRequest) -> None:
    async with asyncio.timeout(60):
        async for _ in client.generate(request):
            pass


async def _keys(server: RedisServer, namespace: str) -> list[bytes]:
    client = aioredis.Redis(port=server.port)
    try:
        return [key async for key in client.scan_iter(match=f"{namespace}:*")]
    finally:
        await client.aclose()


async def _equals(awaitable, expected) -> bool:
    return await awaitable == expected

