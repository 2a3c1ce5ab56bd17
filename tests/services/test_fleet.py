"""Acceptance of the fleet: `kvmesh serve --num-engines 2` behind one processor, real processes, a real
redis-server on a free loopback port as the shared prefix-cache index.

The module's fleet (kv-aware routing, Redis) serves tests 1-4 in order; they leave it as they
found it except where a test says it kills something, and those run last. Test 5 (migration) has a
fleet of its own routed by session, without Redis (the processor asks the engines).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from services.common.clients import EngineInfo, EngineStats, PrefixMatch
from services.common.hashing import hash_token_blocks
from services.engine.client import GrpcEngineClient
from services.processor.router import STATES_MAX_AGE
from tests.redis_server import RedisServer
from tests.services.procs import Serve, client_for, gone, running_serve

NAMESPACE = "kvmesh:pi"  # the default
HEARTBEAT_TTL = 2.0
KV_CACHE = "24MiB"  # 34 blocks an engine: two 304-token prompts fit, the third evicts
PROMPT_TOKENS = 304
SHARED_TOKENS = 256


def wait_for(condition: Callable[[], object], timeout: float, what: str | Callable[[], str]) -> object:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"not within {timeout:g}s: {what() if callable(what) else what}"
        time.sleep(0.1)
    return value


class Fleet:
    """A running 2-engine `kvmesh serve` and what the tests ask of its engines and of Redis."""

    def __init__(self, serve: Serve, redis_server: RedisServer | None) -> None:
        self.serve = serve
        self.redis_server = redis_server
        self.redis = redis.Redis(port=redis_server.port) if redis_server else None
        self.client, self.model = client_for(serve)

    @property
    def engines(self) -> list[str]:
        return sorted(name for name in self.serve.services if name.startswith("engine-"))

    def address(self, engine: str) -> str:
        return self.serve.services[engine]["address"]

    def _call(self, engine: str, method: str, *args):
        async def call():
            client = GrpcEngineClient(self.address(engine), timeout=5, security=self.serve.security)
            try:
                return await getattr(client, method)(*args)
            finally:
                await client.close()
        return asyncio.run(call())

    def info(self, engine: str) -> EngineInfo:
        return self._call(engine, "info")

    def stats(self, engine: str) -> EngineStats:
        return self._call(engine, "stats")

    def match(self, engine: str, chain: list[bytes]) -> PrefixMatch:
        return self._call(engine, "match_prefix", chain)

    def indexed(self, engine: str) -> set[bytes]:
        """The block hashes the index says `engine` holds (its reverse set)."""
        return set(self.redis.smembers(f"{NAMESPACE}:e:{self.info(engine).engine_id}:blocks"))

    def reported_idle(self, engine: str) -> bool:
        """Whether `engine`'s last heartbeat in the index reported nothing running or waiting: the load
        the router adds to its cost (its heartbeat after a request finished)."""
        live = self.redis.hgetall(f"{NAMESPACE}:e:{self.info(engine).engine_id}:live")
        return live.get(b"running") == b"0" and live.get(b"waiting") == b"0"

    def chain(self, token_ids: list[int]) -> list[bytes]:
        info = self.info(self.engines[0])
        return hash_token_blocks(token_ids, info.block_size, info.model_id)

    def complete(self, token_ids: list[int], max_tokens: int = 1, **kwargs):
        return self.client.completions.create(model=self.model, prompt=token_ids, max_tokens=max_tokens,
                                              temperature=0, **kwargs)

    def wait_idle(self, timeout: float = 30.0) -> None:
        for engine in self.engines:
            wait_for(lambda: (s := self.stats(engine)).num_running == s.num_waiting == s.num_used_blocks == 0,
                     timeout, f"{engine} idle")


def random_prompt(rng: random.Random, n: int, prefix: list[int] = ()) -> list[int]:
    return [*prefix, *(rng.randrange(1000, 40000) for _ in range(n - len(prefix)))]


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def fleet(served_model: str, redis_server: RedisServer) -> Iterator[Fleet]:
    args = ["--num-engines", "2", "--prefix-index", redis_server.url, "--routing", "kv-aware",
            "--heartbeat-ttl", str(HEARTBEAT_TTL), "--kv-cache-memory", KV_CACHE, "--max-model-len", "512",
            "--restart-backoff", "4"]
    with running_serve(served_model, extra_args=args) as serve:
        yield Fleet(serve, redis_server)


def test_index_holds_the_prompt_blocks_and_routes_the_shared_prefix_there(fleet: Fleet):
    """Acceptance 1: the index holds exactly the prompt's full blocks, for the engine that served it;
    a second request sharing 256 tokens goes there and reports them all cached."""
    rng = random.Random(1)
    prompt = random_prompt(rng, PROMPT_TOKENS)
    chain = fleet.chain(prompt)
    assert len(chain) == PROMPT_TOKENS // 16
    fleet.complete(prompt)
    served = wait_for(lambda: next((e for e in fleet.engines if fleet.indexed(e) & set(chain)), None), 10,
                      "the prompt's blocks in the index")
    other = next(e for e in fleet.engines if e != served)
    wait_for(lambda: fleet.indexed(served) >= set(chain), 10, "every full block of the prompt indexed")
    assert fleet.indexed(served) == set(chain), "the index holds more than the prompt's full blocks"
    assert not fleet.indexed(other) & set(chain)

    # The router counts what an engine last reported as queued: until the served engine's heartbeat
    # reports the first request gone, one queued request's cost ties the prefix it holds.
    wait_for(lambda: fleet.reported_idle(served), 10, "the served engine's heartbeat reporting it idle")
    time.sleep(2 * STATES_MAX_AGE)  # the processor's copy of the engines' states, refreshed at this age

    hits_before = {e: fleet.stats(e).prefix_cache_hits for e in fleet.engines}
    second = random_prompt(rng, PROMPT_TOKENS, prompt[:SHARED_TOKENS])
    response = fleet.complete(second)
    assert response.usage.prompt_tokens_details.cached_tokens >= SHARED_TOKENS
    assert fleet.stats(served).prefix_cache_hits - hits_before[served] >= SHARED_TOKENS
    assert fleet.stats(other).prefix_cache_hits == hits_before[other]
    fleet.wait_idle()


def test_evicted_blocks_leave_the_index(fleet: Fleet):
    """Acceptance 1, eviction: prompts that fill an engine's cache evict older blocks, and the index
    follows its pool: for every prompt sent, each engine's indexed prefix equals what it holds."""
    rng = random.Random(2)
    prompts = [random_prompt(rng, PROMPT_TOKENS) for _ in range(8)]
    for prompt in prompts:
        fleet.complete(prompt)
    fleet.wait_idle()
    chains = [fleet.chain(p) for p in prompts]
    total = fleet.stats(fleet.engines[0]).num_total_blocks
    assert 8 * len(chains[0]) > 2 * total, "the prompts must not all fit: nothing would be evicted"

    def agree() -> bool:
        for engine in fleet.engines:
            indexed = fleet.indexed(engine)
            for chain in chains:
                held = fleet.match(engine, chain).num_matched_blocks
                if {h for h in chain[:held]} - indexed or any(h in indexed for h in chain[held:held + 1]):
                    return False
        return True
    wait_for(agree, 10, "the index agrees with each engine's pool")
    evicted = sum(fleet.match(e, c).num_matched_blocks < len(c) for e in fleet.engines for c in chains)
    assert evicted > 0


def test_redis_down_routes_by_load_and_prefix_routing_resumes(fleet: Fleet):
    """Acceptance 3: Redis stopped mid-run, requests keep succeeding; started again (empty), the
    engines republish what they cached meanwhile, and requests sharing a prefix go to its engine."""
    rng = random.Random(3)
    fleet.redis_server.stop()
    try:
        during = [random_prompt(rng, 200) for _ in range(4)]
        for prompt in during:
            assert fleet.complete(prompt, max_tokens=4).choices[0].finish_reason == "length"
    finally:
        fleet.redis_server.start()
    for prompt in during:  # cached while nothing could be published: only a republish brings them
        chain = set(fleet.chain(prompt))
        wait_for(lambda: any(fleet.indexed(e) >= chain for e in fleet.engines), 15,
                 lambda: f"the engines republished into the restarted Redis:\n{fleet.serve.log()}")
    for _ in range(3):  # one at a time: a few prompts fill an engine's cache
        prompt = random_prompt(rng, PROMPT_TOKENS)
        chain = set(fleet.chain(prompt))
        fleet.complete(prompt)
        wait_for(lambda: any(fleet.indexed(e) >= chain for e in fleet.engines), 10, "the prompt indexed")
        response = fleet.complete(random_prompt(rng, PROMPT_TOKENS, prompt[:SHARED_TOKENS]))
        assert response.usage.prompt_tokens_details.cached_tokens >= SHARED_TOKENS
    fleet.wait_idle()


def test_killed_engine_leaves_the_index_and_its_restart_inherits_nothing(fleet: Fleet):
    """Acceptance 2: SIGKILL the engine holding a prompt: its entries are gone within the heartbeat
    TTL (a lookup no longer names it; the processor's sweep deletes its keys) and the next request
    goes to the other engine; restarted at the same address (new epoch), it serves none of them."""
    rng = random.Random(4)
    prompt = random_prompt(rng, PROMPT_TOKENS)
    chain = fleet.chain(prompt)
    fleet.complete(prompt)
    victim = wait_for(lambda: next((e for e in fleet.engines if fleet.indexed(e) >= set(chain)), None), 10,
                      "the prompt indexed")
    survivor = next(e for e in fleet.engines if e != victim)
    victim_id, old_epoch = fleet.info(victim).engine_id, fleet.info(victim).epoch
    pid = fleet.serve.services[victim]["pid"]
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(lambda: gone(pid), 10, "the engine gone")
    wait_for(lambda: not fleet.redis.exists(f"{NAMESPACE}:e:{victim_id}:live"), HEARTBEAT_TTL + 1,
             "the victim's heartbeat expired")
    assert time.monotonic() - killed_at <= HEARTBEAT_TTL + 1
    hits_before = fleet.stats(survivor).prefix_cache_hits
    response = fleet.complete(random_prompt(rng, PROMPT_TOKENS, prompt[:SHARED_TOKENS]))
    assert response.choices[0].finish_reason == "length"
    assert fleet.stats(survivor).prefix_cache_hits >= hits_before  # it answered: the victim is down
    wait_for(lambda: not fleet.redis.exists(f"{NAMESPACE}:e:{victim_id}:blocks"), 3 * HEARTBEAT_TTL + 5,
             "the victim's blocks swept from the index")

    # The supervisor restarts the pair on the same ports: a new epoch, an empty pool, nothing indexed.
    def restarted() -> bool:
        try:
            return fleet.info(victim).epoch > old_epoch
        except (ConnectionError, TimeoutError):
            return False
    wait_for(restarted, 120, "the engine restarted")
    assert fleet.info(victim).engine_id == victim_id
    assert not fleet.indexed(victim) & set(chain)
    assert fleet.match(victim, chain).num_matched_blocks == 0


# ----------------------------------------------------------------------------- migration


@pytest.fixture(scope="module")
def session_fleet(served_model: str) -> Iterator[Fleet]:
    """Routed by session (all of one session's streams on one engine), no Redis: the processor asks
    the engines what they hold."""
    args = ["--num-engines", "2", "--routing", "session", "--max-model-len", "512", "--restart-backoff", "30"]
    with running_serve(served_model, extra_args=args) as serve:
        yield Fleet(serve, None)


STORIES = [f"Write a story about {thing}." for thing in ("a lighthouse", "a red fox", "the moon", "a bakery")]


def stream_text(fleet: Fleet, prompt: str, max_tokens: int, chunks: list[str], **kwargs) -> str:
    stream = fleet.client.completions.create(model=fleet.model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_headers={"x-session-id": "one-engine"},
                                             extra_body={"ignore_eos": True}, **kwargs)
    for event in stream:
        chunks.append(event.choices[0].text)
    return "".join(chunks)


def test_streams_survive_the_death_of_their_engine(session_fleet: Fleet):
    """Acceptance 5: SIGKILL the engine while 4 greedy streams run on it: every stream completes,
    token-identical to a run without the kill; the survivor holds no blocks once they end."""
    fleet = session_fleet
    max_tokens = 48
    expected = [stream_text(fleet, p, max_tokens, []) for p in STORIES]
    fleet.wait_idle()

    chunks: list[list[str]] = [[] for _ in STORIES]
    results: list[str | BaseException | None] = [None] * len(STORIES)

    def run(i: int) -> None:
        try:
            results[i] = stream_text(fleet, STORIES[i], max_tokens, chunks[i])
        except BaseException as e:  # reported below
            results[i] = e
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(STORIES))]
    for t in threads:
        t.start()
    wait_for(lambda: all(len(c) >= 3 or r is not None for c, r in zip(chunks, results)), 120,
             "every stream under way")
    assert not any(isinstance(r, BaseException) for r in results), results
    running = {e: fleet.stats(e).num_running for e in fleet.engines}
    victim = max(running, key=running.get)
    assert running[victim] == len(STORIES), f"the session's streams are not all on one engine: {running}"
    survivor = next(e for e in fleet.engines if e != victim)
    os.kill(fleet.serve.services[victim]["pid"], signal.SIGKILL)
    for t in threads:
        t.join(300)
    assert results == expected
    wait_for(lambda: (s := fleet.stats(survivor)).num_running == s.num_used_blocks == 0, 30, "the survivor idle")
