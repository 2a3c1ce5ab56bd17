"""The router (services/processor/router.py) through EngineSet over real in-process engines (AsyncEngine,
each over its own scripted worker: real scheduler, block pool and prefix cache; block size 4), with a
real MemoryPrefixIndex, the engines themselves (EnginesPrefixIndex), or a real redis-server.

The engines' block pools record their KV events into a KVEventQueue that the tests drain into the index,
as an engine's publisher does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.common.clients import EngineInfo
from services.common.config import ProcessorServiceConfig, RoutingConfig, SchedulerConfig
from services.common.discovery import Endpoint
from services.common.engine_output import EngineCoreOutput, EngineCoreRequest
from services.common.kv_events import AllBlocksCleared, BlockStored
from services.common.metrics import ServiceMetrics
from services.common.model_files import model_id_of
from services.common.sampling_params import SamplingParams
from services.engine.async_engine import AsyncEngine
from services.engine.client import GrpcEngineClient
from services.engine.kv_event_queue import KVEventQueue
from services.engine.request import Request
from services.prefix_index import EngineLoad, MemoryPrefixIndex, RedisPrefixIndex
from services.prefix_index.engines_index import EnginesPrefixIndex
from services.processor import server as processor_server
from services.processor.engine_set import EngineSet
from services.processor.metrics import RouterMetrics
from services.processor.router import REASONS, predicted_cached_tokens, prompt_chain, session_score
from tests.redis_server import RedisServer
from tests.unit.test_async_engine import ScriptedWorker

pytestmark = pytest.mark.anyio

A, B = "127.0.0.1:1", "127.0.0.1:2"  # the engines' names (never dialled: the engines are in-process)
BLOCK_SIZE = 4  # ScriptedWorker's
SCRIPTED = EngineInfo("scripted", "/nowhere", 4096, BLOCK_SIZE)


class ClosableEngine(AsyncEngine):
    """An AsyncEngine that EngineSet can close as it closes a gRPC client; records its KV events."""

    async def close(self) -> None:
        await self.shutdown()


async def start_engine() -> ClosableEngine:
    engine = await ClosableEngine.create(ScriptedWorker(num_blocks=64),
                                         SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8))
    engine.core.kv_cache_manager.block_pool.events = KVEventQueue()  # before any request: a full history
    return engine


@pytest.fixture
async def engines() -> AsyncIterator[dict[str, ClosableEngine]]:
    started = {A: await start_engine(), B: await start_engine()}
    try:
        yield started
    finally:
        for engine in started.values():
            await engine.shutdown()


def engine_set(engines: dict[str, ClosableEngine], routing: str = "kv-aware", index=None,
               **config) -> EngineSet:
    metrics = RouterMetrics(ServiceMetrics.create("processor")).of("smollm2")
    members = EngineSet("engines", engines.__getitem__, RoutingConfig(routing=routing, **config), index, 0.5,
                        metrics)
    members.router.states_max_age = 0  # these tests change loads between routes: read them every time
    members.update(frozenset(Endpoint(a) for a in engines))
    return members


def request(request_id: str, prompt: list[int], session_id: str | None = None,
            cache_salt: str | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, prompt, SamplingParams(temperature=0, max_tokens=2), eos_token_ids=(2,),
                             cache_salt=cache_salt, session_id=session_id)


def prompt(first: int, length: int) -> list[int]:
    return list(range(first, first + length))


async def run(members: EngineSet, r: EngineCoreRequest) -> list[EngineCoreOutput]:
    """The request's outputs, through EngineSet.generate (routed)."""
    return [out async for out in members.generate(r)]


async def publish(engines: dict[str, ClosableEngine], index) -> None:
    """Each engine's recorded KV events into the index (epoch 1), as its publisher would."""
    for address, engine in engines.items():
        await index.apply(address, 1, engine.core.kv_cache_manager.block_pool.events.take().events)


async def resync(engines: dict[str, ClosableEngine], index, tokens: list[int]) -> None:
    """Each engine's holding of `tokens`' blocks, published afresh (into an index that lost everything)."""
    chain = prompt_chain(request("x", tokens), SCRIPTED)
    for address, engine in engines.items():
        engine.core.kv_cache_manager.block_pool.events.take()
        held = engine.core.kv_cache_manager.num_matched_blocks(chain)
        await index.apply(address, 1, [AllBlocksCleared(), BlockStored(chain[:held], None, tokens[:held * BLOCK_SIZE],
                                                                       BLOCK_SIZE)])


def holder(engines: dict[str, ClosableEngine], tokens: list[int]) -> str:
    """The one engine whose prefix cache holds the prompt (the one that served it)."""
    chain = prompt_chain(request("x", tokens), SCRIPTED)
    held = [a for a, e in engines.items() if e.core.kv_cache_manager.num_matched_blocks(chain) == len(chain)]
    assert len(held) == 1, held
    return held[0]


def decisions(members: EngineSet) -> dict[tuple[str, str], float]:
    """routing decisions counted, by (policy, reason)."""
    found = {}
    for metric in members.metrics.decisions.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                found[sample.labels["policy"], sample.labels["reason"]] = sample.value
    return found


def sample(metric, suffix: str) -> float:
    return sum(s.value for m in metric.collect() for s in m.samples if s.name.endswith(suffix))


def bucket(metric, le: float) -> float:
    """A histogram's cumulative count at bucket bound `le` (with negative bounds there is no _sum)."""
    return sum(s.value for m in metric.collect() for s in m.samples
               if s.name.endswith("_bucket") and float(s.labels["le"]) == le)


# ----------------------------------------------------------------------------- hashing


def test_the_routers_chain_is_the_engines(tokenizer, model_path) -> None:
    """For a real prompt of the real model, with and without a cache salt, the chain the router looks up
    is the one the engine's Request computes (and the salt changes every block of it)."""
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)
    info = EngineInfo(model_id_of(model_path), str(model_path), 2048, 16)
    for salt in (None, "tenant-7"):
        engine_request = Request("r", ids, SamplingParams(), 1, info.block_size, model_id=info.model_id,
                                 cache_salt=salt)
        chain = prompt_chain(request("r", ids, cache_salt=salt), info)
        assert chain == engine_request.block_hashes and len(chain) == len(ids) // 16 > 2
    salted = prompt_chain(request("r", ids, cache_salt="tenant-7"), info)
    assert not set(salted) & set(prompt_chain(request("r", ids), info))


def test_predicted_cached_tokens_never_cover_the_last_token() -> None:
    assert predicted_cached_tokens(10, 40, 4) == 36  # 40 tokens: at most 39 hit, so 9 whole blocks
    assert predicted_cached_tokens(10, 41, 4) == 40
    assert predicted_cached_tokens(3, 41, 4) == 12
    assert predicted_cached_tokens(0, 41, 4) == 0


# ----------------------------------------------------------------------------- kv-aware


async def test_kv_aware_asks_the_engines_and_follows_the_prefix(engines) -> None:
    """No index given: the engines are asked. A prompt nobody holds spreads by load; one that shares a
    cached prefix goes where the prefix is, and the engine reports exactly the predicted cached tokens."""
    members = engine_set(engines)
    first = prompt(100, 40)
    outputs = await run(members, request("r-0", first))
    assert outputs[0].num_cached_tokens == 0
    served_by = holder(engines, first)
    # 36 of 40 shared (9 blocks); the rest differs.
    second = first[:36] + [7, 8, 9, 10, 11, 12]
    assert (await members.choose(request("r-1", second))).address == served_by
    outputs = await run(members, request("r-1", second))
    assert outputs[0].num_cached_tokens == 36
    assert decisions(members) == {("kv-aware", "no_hit"): 1, ("kv-aware", "prefix_hit"): 2}
    assert sample(members.metrics.prediction_error, "_count") == 2  # r-0 (0 predicted) and r-1 (36)
    assert bucket(members.metrics.prediction_error, 0) == 2 and bucket(members.metrics.prediction_error, -1) == 0
    assert sample(members.metrics.mispredictions, "_total") == 0
    assert sample(members.metrics.seconds, "_count") == 3
    await members.close()


async def test_no_hit_spreads_by_load_in_turn(engines) -> None:
    members = engine_set(engines)
    chosen = [(await members.choose(request(f"r-{i}", prompt(1000 * (i + 1), 20)))).address for i in range(4)]
    assert chosen == [A, B, A, B]
    members.members[A].in_flight = 1  # A busier: B until they are even
    assert (await members.choose(request("r-9", prompt(9000, 20)))).address == B
    assert decisions(members) == {("kv-aware", "no_hit"): 5}
    members.members[A].in_flight = 0
    await members.close()


async def test_cost_weighs_the_hit_against_the_queue(engines) -> None:
    """Engine A holds 8 of the prompt's 10 blocks (32 tokens cached of 40): cost 8 + 4 per queued request,
    against B's 40 + 4 per queued request (routing_request_cost=4). The index's loads count as queue."""
    index = MemoryPrefixIndex()
    members = engine_set(engines, index=index, routing_request_cost=4)
    shared = prompt(500, 40)
    chain = prompt_chain(request("x", shared), SCRIPTED)
    await index.apply(A, 1, [BlockStored(chain[:8], None, shared[:32], BLOCK_SIZE)])
    await index.heartbeat(B, 1, EngineLoad(0, 0, 64, 0.0))
    members.members[A].in_flight = 8  # 8 + 32 = 40 against B's 40: a tie, taken in turn
    tied = {(await members.choose(request(f"t-{i}", shared))).address for i in range(2)}
    assert tied == {A, B}
    members.members[A].in_flight = 7  # 36 < 40
    assert (await members.choose(request("r-1", shared))).address == A
    members.members[A].in_flight = 0
    await index.heartbeat(A, 1, EngineLoad(num_running=9, num_waiting=1, num_free_blocks=10, kv_cache_usage=0.8))
    assert (await members.choose(request("r-2", shared))).address == B  # 8 + 40 > 40: A's own report of its queue
    await index.heartbeat(B, 1, EngineLoad(num_running=3, num_waiting=0, num_free_blocks=64, kv_cache_usage=0.1))
    assert (await members.choose(request("r-3", shared))).address == A  # 48 < 52
    assert decisions(members) == {("kv-aware", "prefix_hit"): 5}
    await members.close()


async def test_engine_loads_are_reread_in_the_background_once_stale(engines) -> None:
    """A decision costs one index round trip: the loads (which change with heartbeats) are read once,
    then again in the background when older than states_max_age; the stale ones serve meanwhile."""
    index = MemoryPrefixIndex()
    members = engine_set(engines, index=index, routing_request_cost=4)
    members.router.states_max_age = 0.2
    shared = prompt(500, 40)
    chain = prompt_chain(request("x", shared), SCRIPTED)
    await index.apply(A, 1, [BlockStored(chain[:8], None, shared[:32], BLOCK_SIZE)])
    await index.heartbeat(B, 1, EngineLoad(0, 0, 64, 0.0))
    assert (await members.choose(request("r-0", shared))).address == A  # read now: A is idle
    await index.heartbeat(A, 1, EngineLoad(num_running=9, num_waiting=1, num_free_blocks=10, kv_cache_usage=0.8))
    assert (await members.choose(request("r-1", shared))).address == A  # the read of r-0 still serves
    await asyncio.sleep(0.25)
    await members.choose(request("r-2", shared))  # stale: starts a re-read, routes on the old loads
    await asyncio.sleep(0.05)
    assert (await members.choose(request("r-3", shared))).address == B  # A's report of its queue arrived
    await members.close()


async def test_the_imbalance_guard_sends_to_the_idlest(engines) -> None:
    index = MemoryPrefixIndex()
    members = engine_set(engines, index=index, routing_imbalance=3, routing_request_cost=0)
    shared = prompt(500, 40)
    chain = prompt_chain(request("x", shared), SCRIPTED)
    await index.apply(A, 1, [BlockStored(chain, None, shared, BLOCK_SIZE)])
    members.members[A].in_flight = 3  # busiest - idlest == 3: not above the limit
    assert (await members.choose(request("r-0", shared))).address == A
    members.members[A].in_flight = 4
    assert (await members.choose(request("r-1", shared))).address == B
    assert decisions(members) == {("kv-aware", "prefix_hit"): 1, ("kv-aware", "imbalance"): 1}
    members.members[A].in_flight = 0
    await members.close()


async def test_a_wrong_index_is_counted_as_a_misprediction(engines) -> None:
    """The index says A holds a prompt it never saw: the router predicts 36 cached tokens, A reports 0."""
    index = MemoryPrefixIndex()
    members = engine_set(engines, index=index)
    stale = prompt(700, 40)
    chain = prompt_chain(request("x", stale), SCRIPTED)
    await index.apply(A, 1, [BlockStored(chain, None, stale, BLOCK_SIZE)])
    outputs = await run(members, request("r-0", stale))
    assert outputs[0].num_cached_tokens == 0
    error = members.metrics.prediction_error  # -36: in (-64, -32]
    assert (bucket(error, -64), bucket(error, -32), sample(error, "_count")) == (0, 1, 1)
    assert sample(members.metrics.mispredictions, "_total") == 1
    await members.close()


async def test_engines_prefix_index_answers_what_each_engine_holds(engines) -> None:
    first, second = prompt(100, 40), prompt(300, 24)
    for address, (request_id, tokens) in zip((A, B), (("r-a", first), ("r-b", second))):
        [_ async for _ in engines[address].generate(request(request_id, tokens))]
    index = EnginesPrefixIndex(lambda: dict(engines), timeout_s=1.0)
    first_chain, second_chain = (prompt_chain(request("x", p), SCRIPTED) for p in (first, second))
    assert await index.longest_prefix(first_chain) == {A: 10}
    assert await index.longest_prefix(second_chain) == {B: 6}
    assert await index.longest_prefix(first_chain[:4] + second_chain[4:]) == {A: 4}
    assert await index.longest_prefix(prompt_chain(request("x", prompt(900, 8)), SCRIPTED)) == {}
    states = await index.engines()
    assert set(states) == {A, B} and all(s.load.num_running == 0 and s.load.num_free_blocks > 0
                                         for s in states.values())
    members = engine_set(engines)
    match = await members.match_prefix(second_chain)  # the set answers as its best engine
    assert match.num_matched_blocks == 6
    with pytest.raises(TypeError, match="read-only"):
        await index.apply(A, 1, [])
    await members.close()


async def test_an_index_in_redis_that_goes_away_and_comes_back(engines) -> None:
    """Up: routed by prefix. Stopped: routed by load, requests still served. Started again (empty, as a
    restarted Redis without persistence is) and fed again: routed by prefix again."""
    server = RedisServer().start()
    index = RedisPrefixIndex.connect(server.url, timeout_s=0.2, namespace="router-test", heartbeat_ttl_s=30)
    members = engine_set(engines, index=index)
    try:
        shared = prompt(100, 40)
        await run(members, request("r-0", shared))
        await publish(engines, index)
        served_by = holder(engines, shared)
        assert (await members.choose(request("r-1", shared))).address == served_by
        server.stop()
        outputs = await run(members, request("r-2", shared))  # no error: by load
        assert outputs[-1].finish_reason == "length"
        assert (await members.choose(request("r-3", shared))).address in (A, B)
        server.start()
        await resync(engines, index, shared)  # what the engines' publishers send after an outage
        holders = {a for a, e in engines.items()
                   if e.core.kv_cache_manager.num_matched_blocks(prompt_chain(request("x", shared), SCRIPTED))}
        assert (await members.choose(request("r-4", shared))).address in holders
        counts = decisions(members)
        assert counts == {("kv-aware", "no_hit"): 1, ("kv-aware", "prefix_hit"): 2, ("kv-aware", "index_down"): 2}
    finally:
        await members.close()
        await index.close()
        server.close()


# ----------------------------------------------------------------------------- other policies


async def test_round_robin_and_least_load(engines) -> None:
    members = engine_set(engines, routing="round-robin")
    members.members[A].in_flight = 5  # round-robin does not look
    chosen = [(await members.choose(request(f"r-{i}", prompt(1, 8)))).address for i in range(4)]
    assert chosen == [A, B, A, B]
    least = engine_set(engines, routing="least-load")
    least.members[A].in_flight = 2
    assert [(await least.choose(request(f"l-{i}", prompt(1, 8)))).address for i in range(2)] == [B, B]
    assert decisions(members) == {("round-robin", "round_robin"): 4}
    assert decisions(least) == {("least-load", "least_load"): 2}
    members.members[A].in_flight = least.members[A].in_flight = 0
    await members.close()


async def test_session_affinity_while_the_engine_is_ready(engines) -> None:
    members = engine_set(engines, routing="session")
    sessions = [f"user-{i}" for i in range(8)]
    expected = {s: max((A, B), key=lambda a: session_score(s, a)) for s in sessions}
    assert set(expected.values()) == {A, B}  # the sessions spread
    for i in range(3):
        for s in sessions:
            members.members[expected[s]].in_flight = 0 if expected[s] == A else 9  # load does not matter
            assert (await members.choose(request(f"{s}-{i}", prompt(1, 8), session_id=s))).address == expected[s]
    members.members[B].in_flight = 0
    on_b = next(s for s in sessions if expected[s] == B)
    members.update(frozenset({Endpoint(A)}))  # B leaves: its sessions move, A's stay
    assert (await members.choose(request("moved", prompt(1, 8), session_id=on_b))).address == A
    members.update(frozenset({Endpoint(A), Endpoint(B)}))  # back: the session returns to B
    assert (await members.choose(request("back", prompt(1, 8), session_id=on_b))).address == B
    members.members[A].in_flight = 1
    assert (await members.choose(request("anon", prompt(1, 8)))).address == B  # no session: least-load
    counts = decisions(members)
    assert counts[("session", "least_load")] == 1 and counts[("session", "only_one")] == 1
    members.members[A].in_flight = 0
    await members.close()


async def test_exclude_and_no_engine_left(engines) -> None:
    members = engine_set(engines)
    assert (await members.choose(request("r", prompt(1, 8)), exclude=frozenset({A}))).address == B
    with pytest.raises(ConnectionError, match="no ready engine in service engines besides"):
        await members.choose(request("r", prompt(1, 8)), exclude=frozenset({A, B}))
    await members.close()


async def test_open_engines_by_source() -> None:
    """One address: a plain gRPC client; several: an EngineSet over them, routed by the flags' policy."""
    async with processor_server.open_engines(ProcessorServiceConfig(engine_address=(A,))) as one:
        assert isinstance(one, GrpcEngineClient)
    routing = processor_server.Routing(RoutingConfig(routing="round-robin"))
    async with processor_server.open_engines(ProcessorServiceConfig(engine_address=(A, B)),
                                             routing=routing) as several:
        assert isinstance(several, EngineSet) and set(several.members) == {A, B}
        assert several.router.config.routing == "round-robin"
        assert isinstance(several.router.index, EnginesPrefixIndex)  # no --prefix-index: ask the engines


async def test_engines_from_the_index_heartbeats(engines) -> None:
    """--engines-from-index: the index's live engines are the members, followed as they come and go."""
    index = MemoryPrefixIndex(heartbeat_ttl_s=30)
    members = EngineSet("engines", engines.__getitem__, RoutingConfig(), index)
    follow = asyncio.create_task(processor_server.follow_index_engines(index, members.update, interval=0.01))

    async def members_become(expected: set[str]) -> None:
        async with asyncio.timeout(5):
            while {a for a, m in members.members.items() if m.ready} != expected:
                await asyncio.sleep(0.01)
    try:
        await members_become(set())
        await index.heartbeat(A, 1, EngineLoad(0, 0, 64, 0.0))
        await members_become({A})
        await index.heartbeat(B, 1, EngineLoad(0, 0, 64, 0.0))
        await members_become({A, B})
        await index.clear(B)  # gone from the index (swept, or cleared): no more requests for it
        await members_become({A})
        assert (await members.choose(request("r", prompt(1, 8)))).address == A
    finally:
        follow.cancel()
        await members.close()


async def test_the_processor_sweeps_expired_engines() -> None:
    """An engine whose heartbeat expired is swept by the processor's timer: coming back with the same
    epoch, its old blocks no longer count (unswept, they would)."""
    index = MemoryPrefixIndex(heartbeat_ttl_s=0.05)
    chain = prompt_chain(request("x", prompt(1, 8)), SCRIPTED)
    for swept in (False, True):
        await index.apply(A, 1, [BlockStored(chain, None, prompt(1, 8), BLOCK_SIZE)])
        if swept:
            async with processor_server.background(processor_server.sweep_index(index, 0.01)):
                await asyncio.sleep(0.2)
        else:
            await asyncio.sleep(0.2)
        await index.heartbeat(A, 1, EngineLoad(0, 0, 64, 0.0))
        assert await index.longest_prefix(chain) == ({} if swept else {A: 2})


def test_every_reason_of_the_policy_is_exported_from_the_start() -> None:
    metrics = RouterMetrics(ServiceMetrics.create("processor"), "kv-aware", REASONS["kv-aware"], ["a", "b"])
    samples = {(s.labels["model_name"], s.labels["policy"], s.labels["reason"]): s.value
               for m in metrics.decisions.collect() for s in m.samples if s.name.endswith("_total")}
    assert samples == {(model, "kv-aware", r): 0 for model in ("a", "b") for r in REASONS["kv-aware"]}
    metrics.of("b").observe_decision("kv-aware", "prefix_hit", 0.001)
    [decisions] = [m for m in metrics.decisions.collect()]
    hits = {s.labels["model_name"]: s.value for s in decisions.samples
            if s.name.endswith("_total") and s.labels["reason"] == "prefix_hit"}
    assert hits == {"a": 0, "b": 1}


def test_engine_sources_are_flags() -> None:
    args = processor_server.parse_args(["--engine-address", A, "--engine-address", B, "--routing", "session",
                                        "--prefix-index", "redis://127.0.0.1:1/0", "--routing-imbalance", "2"])
    assert args.service.engine_address == (A, B)
    assert (args.routing.routing, args.routing.routing_imbalance) == ("session", 2)
    assert args.prefix_index.prefix_index == "redis://127.0.0.1:1/0"
    with pytest.raises(SystemExit):
        processor_server.parse_args(["--engine-address", A, "--engine-address", A])
    with pytest.raises(SystemExit):
        processor_server.parse_args(["--engines-from-index"])  # without --prefix-index
    with pytest.raises(SystemExit):  # an index anyone may write names no engine unchecked
        processor_server.parse_args(["--engines-from-index", "--prefix-index", "redis://127.0.0.1:1/0"])
    assert processor_server.parse_args(["--engines-from-index", "--prefix-index", "redis://127.0.0.1:1/0",
                                        "--trust-index-engines"]).service.engine_address == ()
    assert processor_server.parse_args(["--engines-from-index", "--prefix-index", "redis://127.0.0.1:1/0",
                                        "--engine-allowed-address", "10.0.0.0/8"]).service.engine_allowed_address \
        == ("10.0.0.0/8",)


def test_engine_addresses_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("KVMESH_PROCESSOR_ENGINE_ADDRESS", f"{A}, {B}")
    monkeypatch.setenv("KVMESH_PROCESSOR_ROUTING", "least-load")
    args = processor_server.parse_args([])
    assert (args.service.engine_address, args.routing.routing) == ((A, B), "least-load")
