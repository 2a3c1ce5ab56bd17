"""A processor of several models (services/processor/engine_pools.py, model_processors.py) and the
pools `kvmesh serve` starts for them: engines join
the pool of the model they report, each pool routes among its own engines only, and a model not
served is ModelNotFoundError (NOT_FOUND on the wire, 404 at the gateway).

Real in-process engines over scripted workers (tests/unit/test_router.py's), a real MemoryPrefixIndex
shared by both pools. Every scripted engine has the same model id, so their block hashes are equal
across pools: what keeps one model's cached blocks from drawing another model's request is the pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from services import cli
from services.common.clients import GenerateRequest
from services.common.config import ModelConfig, RoutingConfig, SchedulerConfig
from services.common.discovery import Endpoint
from services.common.errors import ModelNotFoundError, exception_of_status, status_of
from services.common.metrics import ServiceMetrics
from services.common.flags import build
from services.common.sampling_params import SamplingParams
from services.engine import server as engine_server
from services.gateway import server as gateway_server
from services.engine.kv_event_queue import KVEventQueue
from services.prefix_index import MemoryPrefixIndex
from services.processor.async_processor import AsyncProcessor
from services.processor.engine_pools import EnginePools
from services.processor.engine_set import EngineSet
from services.processor.metrics import ProcessorMetrics, RouterMetrics
from services.processor.model_processors import ModelProcessors
from services.processor import server as processor_server
from services.processor.processor import Processor
from services.worker import server as worker_server
from tests.unit.test_async_engine import ScriptedWorker
from tests.unit.test_router import ClosableEngine, decisions, holder, prompt, publish, request, run

pytestmark = pytest.mark.anyio

A1, A2, B1, B2, C1 = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:4", "127.0.0.1:5"
MODEL_OF = {A1: "a", A2: "a", B1: "b", B2: "b", C1: "c"}  # c: served by no pool


async def start_engine(model_name: str) -> ClosableEngine:
    engine = await ClosableEngine.create(ScriptedWorker(num_blocks=64),
                                         SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
                                         model_name=model_name)
    engine.core.kv_cache_manager.block_pool.events = KVEventQueue()  # before any request: a full history
    return engine


@pytest.fixture
async def engines() -> AsyncIterator[dict[str, ClosableEngine]]:
    started = {address: await start_engine(model) for address, model in MODEL_OF.items()}
    try:
        yield started
    finally:
        for engine in started.values():
            await engine.shutdown()


def pools_over(engines: dict[str, ClosableEngine], index: MemoryPrefixIndex) -> EnginePools:
    metrics = RouterMetrics(ServiceMetrics.create("processor"))

    def pool(model: str) -> EngineSet:
        members = EngineSet(f"engines of {model}", engines.__getitem__, RoutingConfig(routing="kv-aware"), index, 0.5,
                            metrics.of(model))
        members.router.states_max_age = 0
        return members

    async def ask_model(address: str) -> str:
        return (await engines[address].info()).model_name

    return EnginePools({"a": pool("a"), "b": pool("b")}, ask_model)


def ready(pool: EngineSet) -> set[str]:
    return {a for a, m in pool.members.items() if m.ready}


async def settled(pools: EnginePools, expected: dict[str, set[str]]) -> None:
    async with asyncio.timeout(5):
        while {model: ready(pool) for model, pool in pools.pools.items()} != expected:
            await asyncio.sleep(0.01)


async def test_engines_join_the_pool_of_the_model_they_report(engines) -> None:
    pools = pools_over(engines, MemoryPrefixIndex())
    pools.update(frozenset(Endpoint(a) for a in MODEL_OF))
    await settled(pools, {"a": {A1, A2}, "b": {B1, B2}})  # C1's model is served by no pool: left out
    assert pools.model_of == MODEL_OF
    pools.update(frozenset(Endpoint(a) for a in (A1, B1, B2)))  # A2 left the ready set
    await settled(pools, {"a": {A1}, "b": {B1, B2}})
    assert A2 not in pools.model_of  # asked again should it come back (it may serve another model then)
    await pools.close()


async def test_one_models_cached_blocks_never_draw_another_models_request(engines) -> None:
    """The same prompt, cached on an engine of model a: a's next request goes there (prefix_hit), b's
    stays among b's engines and finds nothing cached, though the hashes are equal."""
    index = MemoryPrefixIndex()
    pools = pools_over(engines, index)
    pools.update(frozenset(Endpoint(a) for a in MODEL_OF))
    await settled(pools, {"a": {A1, A2}, "b": {B1, B2}})
    tokens = prompt(1, 16)
    assert (await run(pools.pools["a"], request("a-1", tokens)))[-1].finished
    await publish(engines, index)
    route_a = await pools.pools["a"]._route(request("a-2", tokens), frozenset())
    route_b = await pools.pools["b"]._route(request("b-1", tokens), frozenset())
    assert (route_a.candidate.address, route_a.reason, route_a.predicted_cached_tokens) == \
        (holder({a: engines[a] for a in (A1, A2)}, tokens), "prefix_hit", 12)
    assert route_b.candidate.address in (B1, B2) and route_b.reason == "no_hit"
    assert decisions(pools.pools["b"])[("kv-aware", "no_hit")] >= 1
    await pools.close()


async def test_each_request_goes_to_its_models_engines(engines, tokenizer, model_path) -> None:
    """Through ModelProcessors: a request naming b runs on an engine of b; naming none, on one of a
    (the first model); naming a model not served, nowhere."""
    pools = pools_over(engines, MemoryPrefixIndex())
    pools.update(frozenset(Endpoint(a) for a in MODEL_OF))
    await settled(pools, {"a": {A1, A2}, "b": {B1, B2}})
    processors = ModelProcessors({model: AsyncProcessor(Processor.for_tokenizer(tokenizer, model_path, 4096), pool)
                                  for model, pool in pools.pools.items()})

    async def served_on(model: str) -> set[str]:
        before = {a: (await e.stats()).prefix_cache_queries for a, e in engines.items()}
        params = SamplingParams(temperature=0, max_tokens=2)
        deltas = [d async for d in processors.generate(GenerateRequest(f"r-{model}", params,
                                                                       prompt_token_ids=prompt(1, 8), model=model))]
        assert deltas[-1].choices[-1].finish_reason is not None
        return {a for a, e in engines.items() if (await e.stats()).prefix_cache_queries > before[a]}

    try:
        assert len(await served_on("b")) == 1 and (await served_on("b")) <= {B1, B2}
        assert len(await served_on("")) == 1 and (await served_on("")) <= {A1, A2}
        assert (await processors.model_info("b")).model_name == "b"
        with pytest.raises(ModelNotFoundError, match="gpt-4"):
            await processors.model_info("gpt-4")
        with pytest.raises(ModelNotFoundError):
            await anext(aiter(processors.generate(GenerateRequest("r-x", SamplingParams(), prompt="hi", model="gpt-4"))))
    finally:
        processors.close()
        await pools.close()


def test_not_found_travels_over_grpc() -> None:
    # Over gRPC: NOT_FOUND with the name, raised again as ModelNotFoundError by the client.
    status = status_of(ModelNotFoundError("gpt-4"))
    assert status.code == grpc.StatusCode.NOT_FOUND
    again = exception_of_status(status.code, status.details)
    assert isinstance(again, ModelNotFoundError) and str(again) == "gpt-4"


def test_each_model_has_its_own_vllm_series() -> None:
    """One registry, one family per metric; each model's series under its model_name."""
    service = ServiceMetrics.create("processor")
    metrics = ProcessorMetrics.for_models(service, {"a": 256, "b": 2048})
    metrics["a"].observe_finished([3])
    metrics["b"].observe_finished([5, 9])
    counts = {s.labels["model_name"]: s.value for m in service.registry.collect() for s in m.samples
              if s.name == "vllm:request_params_n_sum"}
    assert counts == {"a": 1, "b": 2}


def test_serve_starts_a_pool_per_model(tmp_path) -> None:
    """`kvmesh serve --model smollm2 --model /m --served-model-name s --served-model-name m`: each
    model's worker loads it and its engine reports its name; the processor tokenizes both; the
    gateway knows both names."""
    parser = cli.build_serve_parser()
    spec = cli.serve_spec(parser, parser.parse_args(["--model", "smollm2", "--model", "/m", "--served-model-name", "s",
                                                     "--served-model-name", "m"]))
    groups = cli.groups_for(spec.serve, 1, len(spec.models))
    assert [(g.workers, g.engine, g.model) for g in groups] == [(("worker-m0",), "engine-m0", 0),
                                                                (("worker-m1",), "engine-m1", 1)]
    layout = cli.Layout(groups, tmp_path, {name: 1 for name in cli.internal_names(groups)})
    argvs = cli.service_argvs(spec, layout)
    worker = worker_server.build_parser()
    assert build(worker, ModelConfig, worker.parse_args(argvs["worker-m1"])).name == "m"
    assert build(worker, ModelConfig, worker.parse_args(argvs["worker-m1"])).model == "/m"
    assert engine_server.parse_args(argvs["engine-m0"]).model.served_model_name == "s"
    processor = processor_server.parse_args(argvs["processor"])
    assert [(m.model, m.name) for m in processor.models] == [("smollm2", "s"), ("/m", "m")]
    gateway = gateway_server.build_parser().parse_args(argvs["gateway"])
    assert gateway.served_model_name == ["s", "m"]
    with pytest.raises(SystemExit):  # disaggregation serves one model
        cli.serve_spec(parser, parser.parse_args(["--model", "a", "--model", "b", "--prefill-engines", "1",
                                                  "--decode-engines", "1"]))
