"""The prefix-cache index: the in-memory and the Redis implementation give the same answers, and the
Redis one leaves exactly the keys its schema promises (docs/features/prefix_index.md) after every call.

A real redis-server runs on a free loopback port for the module, in a temporary folder, and is killed
by its pid; each test works in its own key namespace.
"""

from __future__ import annotations

import hashlib
import random
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import redis.asyncio as aioredis

from services.common.hashing import BlockHash
from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, CacheSnapshot
from services.prefix_index import (
    EngineLoad,
    EngineState,
    MemoryPrefixIndex,
    PrefixIndex,
    RedisPrefixIndex,
    StaleEpochError,
)
from tests.redis_server import RedisServer

pytestmark = pytest.mark.anyio

BLOCK_SIZE = 16
H = [hashlib.sha256(b"block %d" % i).digest() for i in range(12)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def redis_port() -> Iterator[int]:
    server = RedisServer().start()
    try:
        yield server.port
    finally:
        server.close()


class Dump:
    """Everything under one namespace, read back from Redis: {key: value} with sets as Python sets."""

    def __init__(self, client: aioredis.Redis, namespace: str) -> None:
        self.client, self.ns = client, namespace.encode()

    async def __call__(self) -> dict[bytes, object]:
        out: dict[bytes, object] = {}
        async for key in self.client.scan_iter(match=self.ns + b":*", count=1000):
            kind = (await self.client.type(key)).decode()
            if kind == "set":
                out[key] = await self.client.smembers(key)
            elif kind == "string":
                out[key] = await self.client.get(key)
            elif kind == "hash":
                out[key] = await self.client.hgetall(key)
            elif kind == "stream" and key == self.ns + b":events":
                continue  # what replicas follow: tests/unit/test_prefix_index_replica.py
            else:
                raise AssertionError(f"unexpected {kind} key {key!r}")
        return out


@pytest.fixture(params=["memory", "redis"])
async def make_index(request: pytest.FixtureRequest, redis_port: int) -> AsyncIterator[Callable]:
    """make_index(heartbeat_ttl_s) -> a fresh index of the parametrized kind, in its own namespace.
    `make_index.dump` reads the Redis namespace back (None for the in-memory index)."""
    made = []
    namespace = f"t{uuid.uuid4().hex[:8]}"

    def make(heartbeat_ttl_s: float = 30.0) -> PrefixIndex:
        if request.param == "memory":
            index = MemoryPrefixIndex(heartbeat_ttl_s)
        else:
            index = RedisPrefixIndex.connect(f"redis://127.0.0.1:{redis_port}/0", 1.0, namespace, heartbeat_ttl_s)
        made.append(index)
        return index

    make.kind = request.param
    dump_client = aioredis.Redis(port=redis_port)
    make.dump = Dump(dump_client, namespace) if request.param == "redis" else None
    make.namespace = namespace.encode()
    yield make
    for index in made:
        await index.close()
    await dump_client.aclose()


def stored(*hashes: BlockHash) -> BlockStored:
    return BlockStored(list(hashes), None, [0] * (BLOCK_SIZE * len(hashes)), BLOCK_SIZE)


def removed(*hashes: BlockHash) -> BlockRemoved:
    return BlockRemoved(list(hashes))


def check(index: PrefixIndex) -> None:
    if isinstance(index, MemoryPrefixIndex):
        index.check_integrity()


async def keys_naming(make_index: Callable, engine_id: str) -> list[bytes]:
    """Redis keys of `engine_id`, and keys of sets that still name it (as `id` or `id:epoch`)."""
    if make_index.dump is None:
        return []
    e = engine_id.encode()
    names_it = re.compile(re.escape(e) + rb"(:\d+)?")
    return [
        key
        for key, value in (await make_index.dump()).items()
        if key.startswith(make_index.namespace + b":e:" + e + b":")
        or (isinstance(value, set) and any(names_it.fullmatch(m) for m in value))
    ]


# ----------------------------------------------------------------------------- lookups


async def test_prefix_lengths_per_engine(make_index):
    index = make_index()
    await index.apply("a", 1, [stored(*H[0:4])])
    await index.apply("b", 1, [stored(H[0], H[1]), stored(H[5])])
    await index.apply("c", 1, [stored(H[1], H[2])])  # not the first block: no prefix at all
    assert await index.longest_prefix(H[0:5]) == {"a": 4, "b": 2}
    assert await index.longest_prefix(H[0:1]) == {"a": 1, "b": 1}
    assert await index.longest_prefix(H[1:3]) == {"a": 2, "b": 1, "c": 2}
    assert await index.longest_prefix([H[9]]) == {}
    assert await index.longest_prefix([]) == {}
    check(index)


async def test_a_miss_stops_the_prefix(make_index):
    index = make_index()
    await index.apply("a", 1, [stored(H[0], H[1], H[3], H[4])])
    assert await index.longest_prefix(H[0:5]) == {"a": 2}


async def test_removed_blocks_disappear(make_index):
    index = make_index()
    await index.apply("a", 1, [stored(*H[0:3])])
    await index.apply("b", 1, [stored(*H[0:3])])
    await index.apply("a", 1, [removed(H[1]), removed(H[7])])  # H[7] was never stored: a no-op
    assert await index.longest_prefix(H[0:3]) == {"a": 1, "b": 3}
    await index.apply("b", 1, [removed(H[0])])
    assert await index.longest_prefix(H[0:3]) == {"a": 1}
    await index.apply("a", 1, [removed(H[0], H[2])])
    assert await index.longest_prefix(H[0:3]) == {}
    if make_index.dump:
        ns = make_index.namespace
        dump = await make_index.dump()
        assert {k for k in dump if k.startswith(ns + b":b:")} == {ns + b":b:" + H[1], ns + b":b:" + H[2]}
        assert ns + b":e:a:blocks" not in dump  # emptied, so gone
        assert dump[ns + b":e:b:blocks"] == {H[1], H[2]}
    check(index)


async def test_all_cleared_removes_exactly_that_engines_entries(make_index):
    index = make_index()
    await index.apply("a", 1, [stored(*H[0:3])])
    await index.apply("b", 1, [stored(*H[0:2])])
    await index.apply("a", 1, [stored(H[3]), AllBlocksCleared(), stored(H[0])])
    assert await index.longest_prefix(H[0:3]) == {"a": 1, "b": 2}
    await index.apply("a", 1, [AllBlocksCleared()])
    assert await index.longest_prefix(H[0:3]) == {"b": 2}
    assert set(await index.engines()) == {"a", "b"}  # still alive, only empty
    if make_index.dump:
        ns = make_index.namespace
        dump = await make_index.dump()
        assert {k: v for k, v in dump.items() if k.startswith(ns + b":b:")} == {
            ns + b":b:" + H[0]: {b"b:1"},
            ns + b":b:" + H[1]: {b"b:1"},
        }
        assert ns + b":e:a:blocks" not in dump
    check(index)


async def test_a_snapshot_replaces_exactly_that_engines_entries(make_index):
    index = make_index()
    await index.apply("a", 1, [stored(*H[0:4])])
    await index.apply("b", 1, [stored(*H[0:2])])
    await index.apply("a", 1, [removed(H[3]), CacheSnapshot([H[0], H[1], H[5]]), stored(H[2])])
    assert await index.longest_prefix(H[0:4]) == {"a": 3, "b": 2}
    assert await index.longest_prefix([H[5]]) == {"a": 1}
    await index.apply("a", 1, [CacheSnapshot([])])
    assert await index.longest_prefix(H[0:4]) == {"b": 2}
    if make_index.dump:
        ns = make_index.namespace
        dump = await make_index.dump()
        assert ns + b":e:a:blocks" not in dump
        assert {k: v for k, v in dump.items() if k.startswith(ns + b":b:")} == {
            ns + b":b:" + H[0]: {b"b:1"},
            ns + b":b:" + H[1]: {b"b:1"},
        }
    check(index)


@pytest.mark.slow  # over a second: `make test`, not test-fast
async def test_updates_say_whether_the_index_knew_the_engine(make_index):
    """False tells the engine's publisher to republish its cache: the index (re)created the engine."""
    index = make_index(heartbeat_ttl_s=1.0)
    load = EngineLoad(0, 0, 8, 0.0)
    assert await index.heartbeat("a", 1, load) is False  # its first word
    assert await index.apply("a", 1, [stored(H[0])]) is True
    assert await index.heartbeat("a", 1, load) is True
    assert await index.apply("a", 2, []) is False  # a new incarnation starts empty
    await index.clear("a")
    assert await index.apply("a", 2, [stored(H[0])]) is False
    time.sleep(1.1)  # expired, not swept: its entries were right, they count again
    assert await index.apply("a", 2, []) is True
    assert await index.longest_prefix([H[0]]) == {"a": 1}
    time.sleep(1.1)
    assert await index.sweep() == ["a"]
    assert await index.heartbeat("a", 2, load) is False
    with pytest.raises(StaleEpochError):
        await index.apply("a", 1, [])


async def test_clear_engine_leaves_no_trace(make_index):
    index = make_index()
    await index.apply("10.0.0.1:8000", 5, [stored(*H[0:4])])
    await index.heartbeat("10.0.0.1:8000", 5, EngineLoad(1, 2, 30, 0.5))
    await index.apply("b", 1, [stored(*H[0:2])])
    await index.clear("10.0.0.1:8000")
    await index.clear("never-seen")
    assert await index.longest_prefix(H[0:4]) == {"b": 2}
    assert set(await index.engines()) == {"b"}
    assert await keys_naming(make_index, "10.0.0.1:8000") == []
    # It may come back afterwards, with any epoch: it starts empty.
    await index.apply("10.0.0.1:8000", 1, [stored(H[0])])
    assert await index.longest_prefix(H[0:4]) == {"b": 2, "10.0.0.1:8000": 1}
    check(index)


async def test_restarted_engine_inherits_nothing(make_index):
    index = make_index()
    await index.apply("a", 100, [stored(*H[0:3])])
    await index.heartbeat("a", 100, EngineLoad(4, 0, 10, 0.9))
    await index.apply("a", 200, [stored(H[0])])  # a new incarnation at the same address
    assert await index.longest_prefix(H[0:3]) == {"a": 1}
    assert await index.engines() == {"a": EngineState(200, None)}  # the old load went with it
    with pytest.raises(StaleEpochError):
        await index.apply("a", 100, [stored(H[1])])  # the old incarnation's publisher, late
    with pytest.raises(StaleEpochError):
        await index.heartbeat("a", 100, EngineLoad(0, 0, 10, 0.0))
    assert await index.longest_prefix(H[0:3]) == {"a": 1}
    if make_index.dump:
        dump = await make_index.dump()
        assert not [k for k, v in dump.items() if isinstance(v, set) and b"a:100" in v]
        assert dump[make_index.namespace + b":e:a:epoch"] == b"200"
    check(index)


async def test_epochs_beyond_double_precision(make_index):
    """Nanosecond start times exceed 2**53: the epoch order must still be exact (Lua numbers are doubles)."""
    index = make_index()
    epoch = 1_764_547_200_123_456_789
    await index.apply("a", epoch + 1, [stored(H[0])])
    with pytest.raises(StaleEpochError):
        await index.apply("a", epoch, [stored(H[1])])
    await index.apply("a", epoch + 2, [stored(H[1])])
    assert await index.longest_prefix([H[1]]) == {"a": 1}
    assert await index.longest_prefix([H[0]]) == {}


async def test_engines_report_their_load(make_index):
    index = make_index()
    await index.apply("a", 1, [stored(H[0])])
    assert await index.engines() == {"a": EngineState(1, None)}
    await index.heartbeat("a", 1, EngineLoad(3, 7, 120, 0.25))
    await index.heartbeat("b", 9, EngineLoad(0, 0, 512, 0.0))
    assert await index.engines() == {
        "a": EngineState(1, EngineLoad(3, 7, 120, 0.25)),
        "b": EngineState(9, EngineLoad(0, 0, 512, 0.0)),
    }
    if make_index.dump:
        ttl_ms = await make_index.dump.client.pttl(make_index.namespace + b":e:a:live")
        assert 0 < ttl_ms <= 30_000  # the safety net: no word from the engine, and the key goes
        assert await make_index.dump.client.pttl(make_index.namespace + b":e:a:epoch") == -1
    with pytest.raises(ValueError):
        await index.heartbeat("", 1, EngineLoad(0, 0, 1, 0.0))
    with pytest.raises(ValueError):
        await index.apply("a", -1, [])


@pytest.mark.slow  # over a second: `make test`, not test-fast
async def test_expired_heartbeat_hides_the_engine_and_sweep_removes_it(make_index):
    index = make_index(heartbeat_ttl_s=1.0)
    await index.apply("a", 1, [stored(*H[0:3])])
    await index.heartbeat("a", 1, EngineLoad(1, 0, 8, 0.5))
    time.sleep(0.7)
    await index.apply("b", 1, [stored(*H[0:2])])
    time.sleep(0.45)  # a: over 1.15 s since its last word (expired); b: 0.45 s, room for a slow machine
    assert await index.longest_prefix(H[0:3]) == {"b": 2}
    assert set(await index.engines()) == {"b"}
    # Back with the same epoch before a sweep: its entries were never wrong, they count again.
    await index.apply("a", 1, [])
    assert await index.longest_prefix(H[0:3]) == {"a": 3, "b": 2}
    assert (await index.engines())["a"] == EngineState(1, None)  # its old load expired
    time.sleep(1.1)
    await index.heartbeat("b", 1, EngineLoad(0, 0, 8, 0.0))
    assert await index.sweep() == ["a"]
    assert await keys_naming(make_index, "a") == []
    assert await index.longest_prefix(H[0:3]) == {"b": 2}
    await index.apply("a", 1, [stored(H[0])])  # after a sweep it starts empty
    assert await index.longest_prefix(H[0:3]) == {"a": 1, "b": 2}
    check(index)


# ----------------------------------------------------------------------------- against a model


class Model:
    """The index as plain sets: engine -> (epoch, blocks)."""

    def __init__(self) -> None:
        self.engines: dict[str, tuple[int, set[BlockHash]]] = {}

    def touch(self, engine_id: str, epoch: int) -> set[BlockHash]:
        current = self.engines.get(engine_id)
        if current is None or current[0] < epoch:
            self.engines[engine_id] = (epoch, set())
        return self.engines[engine_id][1]

    def longest_prefix(self, chain: list[BlockHash]) -> dict[str, int]:
        out = {}
        for engine_id, (_, blocks) in self.engines.items():
            n = 0
            while n < len(chain) and chain[n] in blocks:
                n += 1
            if n:
                out[engine_id] = n
        return out

    def redis_keys(self, ns: bytes) -> dict[bytes, object]:
        """What the Redis schema says must be stored, and nothing else (the live hashes' values are
        checked for their epoch only)."""
        out: dict[bytes, object] = {}
        for engine_id, (epoch, blocks) in self.engines.items():
            e = engine_id.encode()
            out[ns + b":e:" + e + b":epoch"] = str(epoch).encode()
            out[ns + b":e:" + e + b":live"] = str(epoch).encode()
            if blocks:
                out[ns + b":e:" + e + b":blocks"] = set(blocks)
            for h in blocks:
                out.setdefault(ns + b":b:" + h, set()).add(b"%s:%d" % (e, epoch))
        if self.engines:
            out[ns + b":engines"] = {e.encode() for e in self.engines}
        return out


@pytest.mark.slow  # over a second: `make test`, not test-fast
async def test_random_events_agree_with_a_model(make_index):
    rng = random.Random(12)
    index = make_index()
    model = Model()
    engine_ids = ["e0", "e1", "10.1.2.3:9000"]
    epochs = dict.fromkeys(engine_ids, 1)
    pool = H[:8]
    for step in range(150):
        engine_id = rng.choice(engine_ids)
        roll = rng.random()
        if roll < 0.05:
            await index.clear(engine_id)
            model.engines.pop(engine_id, None)
        elif roll < 0.10:
            epochs[engine_id] += rng.randint(1, 3)  # a restart
            await index.apply(engine_id, epochs[engine_id], [])
            model.touch(engine_id, epochs[engine_id])
        elif roll < 0.13 and engine_id in model.engines and model.engines[engine_id][0] > 1:
            with pytest.raises(StaleEpochError):
                await index.apply(engine_id, model.engines[engine_id][0] - 1, [stored(pool[0])])
        else:
            events = []
            blocks = set(model.touch(engine_id, epochs[engine_id]))
            for _ in range(rng.randint(1, 4)):
                kind = rng.random()
                picked = rng.sample(pool, rng.randint(1, 4))
                if kind < 0.55:
                    events.append(stored(*picked))
                    blocks |= set(picked)
                elif kind < 0.88:
                    events.append(removed(*picked))
                    blocks -= set(picked)
                elif kind < 0.95:
                    events.append(CacheSnapshot(picked))
                    blocks = set(picked)
                else:
                    events.append(AllBlocksCleared())
                    blocks.clear()
            await index.apply(engine_id, epochs[engine_id], events)
            model.engines[engine_id] = (epochs[engine_id], blocks)
        check(index)
        for length in (1, 3, 8):
            chain = rng.sample(pool, length)
            assert await index.longest_prefix(chain) == model.longest_prefix(chain), f"step {step}"
        assert {k: s.epoch for k, s in (await index.engines()).items()} == {
            k: epoch for k, (epoch, _) in model.engines.items()
        }
        if make_index.dump:
            dump = await make_index.dump()
            for key, value in dump.items():
                if key.endswith(b":live"):
                    dump[key] = value[b"epoch"]
            assert dump == model.redis_keys(make_index.namespace), f"step {step}"


# ----------------------------------------------------------------------------- Redis going away


async def test_redis_stopped_raises_connection_error_within_the_timeout():
    server = RedisServer().start()
    try:
        index = RedisPrefixIndex.connect(server.url, timeout_s=0.3)
        await index.apply("a", 1, [stored(H[0])])
        assert await index.longest_prefix([H[0]]) == {"a": 1}
    finally:
        server.close()
    for call in (
        lambda: index.longest_prefix([H[0]]),
        lambda: index.apply("a", 1, [stored(H[1])]),
        lambda: index.heartbeat("a", 1, EngineLoad(0, 0, 1, 0.0)),
        index.engines,
        index.sweep,
        lambda: index.clear("a"),
    ):
        start = time.monotonic()
        with pytest.raises(ConnectionError):
            await call()
        assert time.monotonic() - start < 1.0
    await index.close()


async def test_redis_that_never_answers_raises_connection_error_within_the_timeout():
    """A server that accepts the connection and then says nothing (a hung Redis, a black hole)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # never accepted: the kernel completes the handshake, nobody answers
        index = RedisPrefixIndex.connect(f"redis://127.0.0.1:{listener.getsockname()[1]}/0", timeout_s=0.3)
        start = time.monotonic()
        with pytest.raises(ConnectionError):
            await index.longest_prefix([H[0]])
        assert 0.25 < time.monotonic() - start < 1.5
        await index.close()
