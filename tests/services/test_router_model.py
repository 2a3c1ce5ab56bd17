"""kv-aware routing end to end over two real engines of the real model (each over its own in-process
worker: two model instances), behind a real AsyncProcessor: prompts that share a system prompt go to the
engine that cached it, and each engine reports exactly the cached tokens the router predicted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.common.clients import GenerateRequest
from services.common.config import EngineArgs, RoutingConfig
from services.common.discovery import Endpoint
from services.common.engine_output import EngineCoreRequest
from services.common.metrics import ServiceMetrics
from services.common.sampling_params import SamplingParams
from services.inprocess import start_worker
from services.prefix_index.engines_index import EnginesPrefixIndex
from services.processor.async_processor import AsyncProcessor
from services.processor.engine_set import EngineSet
from services.processor.metrics import RouterMetrics
from services.processor.processor import Processor
from services.processor.router import prompt_chain
from tests.unit.test_router import A, B, ClosableEngine, bucket, decisions, sample

pytestmark = pytest.mark.anyio

MAX_MODEL_LEN = 512
FIRST = "What is two plus two? Explain the arithmetic step by step, as you would to a child of six."
SECOND = "Name a colour of the rainbow and say in a few words why it is your favourite one today."
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 8  # about 100 tokens


@pytest.fixture(scope="module")
async def fleet(served_model: str) -> AsyncIterator[dict[str, ClosableEngine]]:
    args = EngineArgs.from_kwargs(model=served_model, dtype="float32", kv_cache_memory=16 * 2**20, max_model_len=MAX_MODEL_LEN)
    engines: dict[str, ClosableEngine] = {}
    try:
        for address in (A, B):
            engines[address] = await ClosableEngine.create(start_worker(args), args.scheduler)
        yield engines
    finally:
        for engine in engines.values():
            await engine.shutdown()


async def test_prompts_sharing_a_prefix_follow_it_and_the_prediction_is_exact(fleet, tokenizer, model_path):
    metrics = RouterMetrics(ServiceMetrics.create("processor")).of("smollm2")
    members = EngineSet("engines", fleet.__getitem__, RoutingConfig(), None, 5.0, metrics)
    members.update(frozenset({Endpoint(A), Endpoint(B)}))
    processor = AsyncProcessor(Processor.for_tokenizer(tokenizer, model_path, MAX_MODEL_LEN), members)
    info = await fleet[A].info()

    async def ask(request_id: str, question: str, salt: str | None = None) -> int:
        """The cached tokens the engine reported for the request."""
        request = GenerateRequest(request_id, SamplingParams(temperature=0, max_tokens=2), prompt=SYSTEM + question,
                                  cache_salt=salt)
        deltas = [d async for d in processor.generate(request)]
        return deltas[0].num_cached_tokens

    def holders(question: str, salt: str | None = None) -> dict[str, int]:
        ids = tokenizer.encode(SYSTEM + question)
        chain = prompt_chain(EngineCoreRequest("x", ids, SamplingParams(), cache_salt=salt), info)
        return {a: e.core.kv_cache_manager.num_matched_blocks(chain) for a, e in fleet.items()}

    try:
        assert await ask("r-0", FIRST) == 0
        [first] = [a for a, n in holders(FIRST).items() if n]
        shared_blocks = holders(SECOND)[first]
        assert shared_blocks >= 5  # the system prompt's whole blocks
        assert await ask("r-1", SECOND) == shared_blocks * info.block_size
        assert holders(SECOND)[first] > shared_blocks  # r-1 ran there: its own blocks too
        assert await ask("r-2", SECOND, salt="tenant-7") == 0  # another tenant's cache is not this one
        assert decisions(members) == {("kv-aware", "no_hit"): 2, ("kv-aware", "prefix_hit"): 1}
        error = metrics.prediction_error
        assert (sample(error, "_count"), bucket(error, 0), bucket(error, -1)) == (3, 3, 0)  # every one exact
        assert sample(metrics.mispredictions, "_total") == 0
        # The engines, asked directly, say the same as their block pools.
        index = EnginesPrefixIndex(lambda: dict(fleet), timeout_s=5.0)
        ids = tokenizer.encode(SYSTEM + SECOND)
        chain = prompt_chain(EngineCoreRequest("x", ids, SamplingParams()), info)
        assert await index.longest_prefix(chain) == {a: n for a, n in holders(SECOND).items() if n}
    finally:
        processor.close()
    for engine in fleet.values():  # nothing left running or queued
        stats = await engine.stats()
        assert (stats.num_running, stats.num_waiting) == (0, 0)
