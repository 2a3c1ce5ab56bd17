"""A processor's replica of the Redis prefix index answers what Redis itself answers once it has caught
up: over a random workload, after missing entries of the events stream, after Redis restarted empty;
while Redis is down its lookups fail (the router then routes by load) and they come back with it.

A real redis-server on a free loopback port; each test in its own key namespace.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, CacheSnapshot
from services.prefix_index import EngineLoad, RedisPrefixIndex
from services.prefix_index.replica import PrefixIndexReplica
from tests.redis_server import RedisServer

pytestmark = pytest.mark.anyio

H = [hashlib.sha256(b"block %d" % i).digest() for i in range(10)]
LOAD = EngineLoad(1, 0, 100, 0.1)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


class Pair:
    """An index that writes (as engines do) and a replica that follows it (as a processor does)."""

    def __init__(self, server: RedisServer, heartbeat_ttl_s: float = 30.0) -> None:
        self.namespace = f"t{uuid.uuid4().hex[:8]}"
        self.writer = RedisPrefixIndex.connect(server.url, 0.3, self.namespace, heartbeat_ttl_s)
        self.replica = PrefixIndexReplica.connect(server.url, 0.3, self.namespace, heartbeat_ttl_s)
        self.client = aioredis.Redis(port=server.port)

    async def agree(self, chains: list[list[bytes]]) -> None:
        await self.replica.sync()
        for chain in chains:
            assert await self.replica.longest_prefix(chain) == await self.writer.longest_prefix(chain), chain
        assert await self.replica.engines() == await self.writer.engines()

    async def close(self) -> None:
        await self.replica.close()
        await self.writer.close()
        await self.client.aclose()


@pytest.fixture
async def pair(server: RedisServer) -> AsyncIterator[Pair]:
    pair = Pair(server)
    pair.replica.start()
    yield pair
    await pair.close()


def stored(*hashes: bytes) -> BlockStored:
    return BlockStored(list(hashes), None, [], 16)


async def retry(call, timeout: float = 5.0):
    """`call()` once Redis takes connections again (the clients have no retries of their own)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except ConnectionError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_the_first_lookup_waits_for_the_first_load(server, pair):
    await pair.writer.apply("a", 1, [stored(H[0], H[1])])
    fresh = PrefixIndexReplica.connect(server.url, 0.3, pair.namespace)
    fresh.start()
    try:
        assert await fresh.longest_prefix([H[0], H[1], H[2]]) == {"a": 2}
    finally:
        await fresh.close()


async def test_follows_a_random_workload(pair):
    rng = random.Random(7)
    epochs = {"e0": 1, "e1": 1, "10.0.0.7:9000": 1}
    for step in range(120):
        engine_id = rng.choice(list(epochs))
        roll = rng.random()
        if roll < 0.05:
            await pair.writer.clear(engine_id)
        elif roll < 0.10:
            epochs[engine_id] += 1  # a restart: the old incarnation's blocks go
            await pair.writer.heartbeat(engine_id, epochs[engine_id], LOAD)
        else:
            events = []
            for _ in range(rng.randint(1, 3)):
                kind, picked = rng.random(), rng.sample(H, rng.randint(1, 4))
                events.append(stored(*picked) if kind < 0.6 else BlockRemoved(picked) if kind < 0.9
                              else CacheSnapshot(picked) if kind < 0.97 else AllBlocksCleared())
            await pair.writer.apply(engine_id, epochs[engine_id], events)
        if step % 10 == 9:
            await pair.agree([rng.sample(H, n) for n in (1, 3, 6)] + [H[:4]])


async def test_entries_it_missed_make_it_reload(pair, caplog):
    await pair.writer.apply("a", 1, [stored(*H[:3])])
    await pair.agree([H[:3]])
    await pair.replica.stop()
    for i in range(3, 10):
        await pair.writer.apply("a", 1, [stored(H[i]), BlockRemoved([H[i - 3]])])
    await pair.writer.apply("b", 1, [stored(H[0])])
    await pair.client.xtrim(f"{pair.namespace}:events", maxlen=1, approximate=False)  # what it has not read is gone
    with caplog.at_level(logging.INFO, logger="services.prefix_index.replica"):
        pair.replica.start()
        await pair.agree([H[:3], H[7:], [H[0]]])
    assert "reloading" in caplog.text
    assert await pair.replica.longest_prefix(H[7:]) == {"a": 3}


async def test_redis_down_fails_lookups_and_its_return_resumes_them(server, caplog):
    pair = Pair(server)
    pair.replica.start()
    try:
        await pair.writer.apply("a", 1, [stored(H[0], H[1])])
        await pair.agree([H[:2]])
        server.stop()  # its data with it
        deadline = time.monotonic() + 3.0
        while True:  # the reader notices within its read's bound
            try:
                await pair.replica.longest_prefix(H[:2])
            except ConnectionError:
                break
            assert time.monotonic() < deadline, "lookups still answer from a copy Redis no longer backs"
            await asyncio.sleep(0.05)
        server.start()
        assert await retry(lambda: pair.writer.apply("a", 1, [stored(H[2])])) is False  # Redis forgot it
        await pair.writer.apply("a", 1, [CacheSnapshot([H[0], H[1], H[2]])])  # its publisher resyncs
        await retry(lambda: pair.agree([H[:3], [H[2]]]))  # each pooled connection fails once
        assert await pair.replica.longest_prefix(H[:3]) == {"a": 3}
    finally:
        if server.proc is None or server.proc.poll() is not None:
            server.start()
        await pair.close()


async def test_redis_restarted_empty_is_not_served_from_the_old_copy(server):
    pair = Pair(server)
    pair.replica.start()
    try:
        await pair.writer.apply("a", 1, [stored(H[0], H[1])])
        await pair.writer.apply("b", 1, [stored(H[0])])
        await pair.agree([H[:2]])
        server.stop()
        server.start()
        await retry(lambda: pair.writer.apply("b", 2, [stored(H[5])]))  # only b came back, restarted
        await retry(lambda: pair.agree([H[:2], [H[5]]]))  # each pooled connection fails once
        assert await pair.replica.longest_prefix(H[:2]) == {}
        assert await pair.replica.longest_prefix([H[5]]) == {"b": 1}
    finally:
        await pair.close()


async def test_an_engine_whose_heartbeat_expired_is_not_counted(server):
    pair = Pair(server, heartbeat_ttl_s=0.4)
    pair.replica.start()
    try:
        await pair.writer.apply("a", 1, [stored(H[0])])
        await pair.writer.apply("b", 1, [stored(H[0])])
        await pair.agree([[H[0]]])
        assert await pair.replica.longest_prefix([H[0]]) == {"a": 1, "b": 1}
        deadline = time.monotonic() + 3.0
        while await pair.replica.longest_prefix([H[0]]) != {"b": 1}:
            await pair.writer.heartbeat("b", 1, LOAD)  # b lives on, a stopped speaking
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert set(await pair.replica.engines()) == {"b"}
    finally:
        await pair.close()


async def test_nothing_is_left_in_redis_once_every_engine_is_gone(pair):
    await pair.writer.apply("a", 1, [stored(H[0])])
    await pair.writer.apply("b", 1, [stored(H[1])])
    await pair.writer.clear("a")
    await pair.writer.clear("b")
    assert [key async for key in pair.client.scan_iter(match=f"{pair.namespace}:*")] == []
    await pair.writer.apply("c", 1, [stored(H[2])])  # a new stream: the replica notices and reloads
    await pair.agree([[H[0]], [H[1]], [H[2]]])
    assert await pair.replica.longest_prefix([H[2]]) == {"c": 1}


async def test_a_redis_that_stops_answering_fails_lookups_and_the_copy_reads_on_after(server, caplog):
    pair = Pair(server)
    pair.replica.start()
    try:
        await pair.writer.apply("a", 1, [stored(H[0], H[1])])
        await pair.agree([H[:2]])
        with caplog.at_level(logging.INFO, logger="services.prefix_index.replica"):
            os.kill(server.proc.pid, signal.SIGSTOP)  # our own redis-server: hung, its data kept
            try:
                deadline = time.monotonic() + 3.0
                while True:
                    try:
                        await pair.replica.longest_prefix(H[:2])
                    except ConnectionError:
                        break
                    assert time.monotonic() < deadline, "lookups still answer while Redis is hung"
                    await asyncio.sleep(0.05)
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            await retry(lambda: pair.writer.apply("a", 1, [stored(H[2])]))
            await retry(lambda: pair.agree([H[:3]]))
        assert await pair.replica.longest_prefix(H[:3]) == {"a": 3}
        assert "answers again" in caplog.text and "reloading" not in caplog.text  # read on, no reload
    finally:
        await pair.close()
