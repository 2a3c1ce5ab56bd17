"""Requests that survive an engine's death: two real engine+worker process pairs behind an EngineSet
and the AsyncProcessor in this process. SIGKILL the engine (or its worker) under running streams:
every stream goes on on the other engine, token-identical to a run without the kill, and nothing
stays behind; with max_migrations=0, or no other engine, the caller gets the error."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.common.clients import GenerateRequest
from services.common.config import RoutingConfig
from services.common.discovery import Endpoint
from services.common.errors import EngineDeadError
from services.common.sampling_params import SamplingParams
from services.engine.client import GrpcEngineClient
from services.processor.async_processor import AsyncProcessor
from services.processor.engine_set import EngineSet
from services.processor.processor import Processor
from tests.services.procs import ServiceProcess, engine_command, free_port, start_service, worker_command

pytestmark = pytest.mark.anyio

KV_BYTES = 64 * 2**20
MAX_MODEL_LEN = 512
NUM_TOKENS = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, presence_penalty=0.5, frequency_penalty=0.5,
                        max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS // 2)
PROMPTS = ["The history of the Roman empire", "How to bake bread at home", "A poem about the sea",
           "Explain photosynthesis", "The rules of chess", "Why the sky is blue", "A letter to a friend",
           "The best way to learn a language"]


@dataclass
class Pair:
    """One engine and its worker, started as a user would (services.cli)."""

    model: str
    worker: ServiceProcess | None = None
    engine: ServiceProcess | None = None

    def start(self) -> None:
        worker_port, engine_port = free_port(), free_port()
        self.worker = start_service(worker_command(model=self.model, dtype="float32", port=worker_port,
                                                   kv_cache_memory=KV_BYTES, max_model_len=MAX_MODEL_LEN), worker_port)
        self.engine = start_service(engine_command(worker_address=self.worker.address, port=engine_port), engine_port)

    def running(self) -> bool:
        return all(p is not None and p.proc.poll() is None for p in (self.worker, self.engine))

    def kill(self) -> None:
        for proc in (self.engine, self.worker):
            if proc is not None:
                proc.kill()
                proc.log_path.unlink(missing_ok=True)

    @property
    def endpoint(self) -> Endpoint:
        assert self.engine is not None
        return Endpoint(self.engine.address)


@dataclass
class Pairs:
    members: list[Pair] = field(default_factory=list)

    def running(self) -> list[Pair]:
        """Both pairs up: the ones a test killed start again."""
        for pair in self.members:
            if not pair.running():
                pair.kill()
                pair.start()
        return self.members


@pytest.fixture(scope="module")
def pairs(served_model: str) -> Iterator[Pairs]:
    started = Pairs([Pair(served_model), Pair(served_model)])
    try:
        started.running()
        yield started
    finally:
        for pair in started.members:
            pair.kill()


def connect(address: str) -> GrpcEngineClient:
    return GrpcEngineClient(address, timeout=5.0)


def engine_set(endpoints: list[Endpoint], max_migrations: int) -> EngineSet:
    engines = EngineSet("test", connect, RoutingConfig(routing="least-load", max_migrations=max_migrations))
    engines.update(frozenset(endpoints))
    return engines


def requests(tag: str) -> list[GenerateRequest]:
    return ([GenerateRequest(f"{tag}-greedy-{i}", GREEDY, prompt=p) for i, p in enumerate(PROMPTS)]
            + [GenerateRequest(f"{tag}-seeded", SEEDED, prompt=PROMPTS[0])])


@dataclass
class Collected:
    token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = -1
    finish_reason: str | None = None


async def collect(processor: AsyncProcessor, request: GenerateRequest, into: Collected | None = None) -> Collected:
    out = Collected() if into is None else into
    async for delta in processor.generate(request):
        if out.num_cached_tokens < 0:
            out.num_cached_tokens = delta.num_cached_tokens
        for choice in delta.choices:
            out.token_ids += choice.token_ids
            out.finish_reason = choice.finish_reason or out.finish_reason
    return out


async def until_all_streaming(streams: list[Collected], num_tokens: int = 1) -> None:
    while min(len(s.token_ids) for s in streams) < num_tokens:
        await asyncio.sleep(0.01)


async def kill_when_all_streaming(streams: list[Collected], kill) -> None:
    """Kills once every stream has a few tokens, none all of them: they die mid-stream."""
    while min(len(s.token_ids) for s in streams) < 3:
        await asyncio.sleep(0.01)
    assert max(len(s.token_ids) for s in streams) < NUM_TOKENS, "too late: a stream already finished"
    kill()


async def assert_nothing_left(engines: EngineSet, survivor: GrpcEngineClient) -> None:
    assert engines._owners == {} and all(m.in_flight == 0 for m in engines.members.values())
    for _ in range(100):  # the engine frees a finished request's blocks right after its last output
        stats = await survivor.stats()
        if stats.num_used_blocks == 0:
            break
        await asyncio.sleep(0.05)
    assert (stats.num_running, stats.num_waiting, stats.num_used_blocks) == (0, 0, 0), stats


def processor_over(engines: EngineSet, tokenizer, model_path: Path) -> AsyncProcessor:
    return AsyncProcessor(Processor.for_tokenizer(tokenizer, model_path, MAX_MODEL_LEN), engines)


async def test_streams_go_on_after_their_engine_is_killed(pairs: Pairs, tokenizer, model_path: Path):
    a, b = pairs.running()
    engines = engine_set([a.endpoint], max_migrations=2)  # B joins once every stream runs on A
    processor = processor_over(engines, tokenizer, model_path)
    try:
        expected = await asyncio.gather(*(collect(processor, r) for r in requests("whole")))
        assert all(len(e.token_ids) == NUM_TOKENS for e in expected)

        streams = [Collected() for _ in expected]
        running = [asyncio.create_task(collect(processor, r, s)) for r, s in zip(requests("killed"), streams)]
        await until_all_streaming(streams)  # every stream on A before B can be chosen
        engines.update(frozenset({a.endpoint, b.endpoint}))
        await kill_when_all_streaming(streams, a.engine.kill)
        got = await asyncio.gather(*running)

        for g, e in zip(got, expected):
            assert g.token_ids == e.token_ids  # no token repeated, missing or different
            assert g.finish_reason == "length" and g.num_cached_tokens == e.num_cached_tokens
        assert not engines.members[a.endpoint.address].healthy
        await assert_nothing_left(engines, engines.members[b.endpoint.address].client)
    finally:
        processor.close()
        await engines.close()


async def test_a_killed_worker_migrates_or_fails_as_configured(pairs: Pairs, tokenizer, model_path: Path):
    """The engine lives on without its worker (EngineDeadError): max_migrations=1 moves the stream,
    max_migrations=0 and a set with no other engine give the caller the error."""
    a, b = pairs.running()
    migrating = engine_set([a.endpoint], max_migrations=1)
    never = engine_set([a.endpoint], max_migrations=0)
    alone = engine_set([a.endpoint], max_migrations=2)
    sets = [migrating, never, alone]
    processors = [processor_over(s, tokenizer, model_path) for s in sets]
    try:
        seeded = requests("worker")[-1]
        expected = await collect(processors[0], seeded)
        streams = [Collected() for _ in sets]
        running = [asyncio.create_task(collect(p, GenerateRequest(f"{seeded.request_id}-{i}", seeded.params,
                                                                  prompt=seeded.prompt), s))
                   for i, (p, s) in enumerate(zip(processors, streams))]
        await until_all_streaming(streams)  # every stream on A before B can be chosen
        for engines in (migrating, never):  # B is there for them, not for `alone`
            engines.update(frozenset({a.endpoint, b.endpoint}))
        await kill_when_all_streaming(streams, a.worker.kill)
        got, *errors = await asyncio.gather(*running, return_exceptions=True)

        assert got.token_ids == expected.token_ids
        for error in errors:
            assert isinstance(error, EngineDeadError), error
        for engines in sets:
            await assert_nothing_left(engines, migrating.members[b.endpoint.address].client)
    finally:
        for processor in processors:
            processor.close()
        for engines in sets:
            await engines.close()
