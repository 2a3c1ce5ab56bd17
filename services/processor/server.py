"""The processor service: tokenizer, chat template, validation, detokenizer and stop strings over an
engine reached by gRPC.

    python -m services.processor.server --model smollm2 --engine-address 127.0.0.1:50052 --port 50051
    python -m services.processor.server --model smollm2 --engine-service kvmesh-engine   # in Kubernetes

config -> tokenizer (no weights) + engines -> AsyncProcessor -> ProcessorServicer ->
grpc.aio server (+ health, reflection) -> SIGTERM -> NOT_SERVING -> drain -> stop(grace). Health
follows the engine's, checked every second. Flags come from services/common/config.py
(ProcessorServiceConfig, ModelConfig's model fields, ServingConfig); each falls back to
KVMESH_PROCESSOR_<FIELD> (KVMESH_PROCESSOR_PORT, KVMESH_PROCESSOR_ENGINE_ADDRESS, ...).

The engines: one GrpcEngineClient at a single --engine-address; an EngineSet over several
--engine-address, over the ready endpoints of --engine-service (followed through the Kubernetes API,
EndpointWatcher) or over the live engines of --prefix-index (--engines-from-index, polled). An
EngineSet routes each request by --routing (services/processor/router.py), reading its replica of the
Redis index of --prefix-index (and sweeping its expired engines every --heartbeat-ttl), else asking
the engines; the
processor is SERVING while at least one engine is ready and healthy.

Several models (--model A --model B, --served-model-name once per model): one tokenizer and one
EngineSet per model; each engine found joins the set of the model it reports (EnginePools), and each
request goes to its model's (ModelProcessors).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from transformers import PreTrainedTokenizerBase

from services.common.clients import EngineClient, EngineInfo, ProcessorClient
from services.common.config import (
    GRAMMAR_COMPILE_FIELDS,
    DisaggregationConfig,
    FleetConfig,
    GrammarLimits,
    LoRAConfig,
    PROCESSOR_MODEL_FIELDS,
    ModelConfig,
    PrefixIndexConfig,
    ProcessorServiceConfig,
    RoutingConfig,
    SecurityConfig,
    ServingConfig,
)
from services.common.flags import add_flags, build
from services.common.discovery import Endpoint, EndpointWatcher, kube_configuration
from services.common.errors import answers_with_status
from services.common.metrics import GrpcMetrics, MetricsEndpoint, ServiceMetrics
from services.common.model_files import model_id_of, resolve_tokenizer
from services.common.ports import DEFAULT_PORTS, default_address
from services.common.rpc import convert
from services.common.rpc.kvmesh.v1 import engine_pb2, processor_pb2, processor_pb2_grpc
from services.common.rpc.security import PROCESSOR, RpcSecurity
from services.common.rpc.server import RpcServer, service_name
from services.engine.client import GrpcEngineClient
from services.processor.async_processor import DEFAULT_TOKENIZER_THREADS, AsyncProcessor
from services.processor.engine_pools import EnginePools
from services.processor.engine_set import EngineSet
from services.processor.index_engines import IndexEngines
from services.prefix_index.index import PrefixIndex
from services.prefix_index.redis_index import RedisAccess
from services.prefix_index.replica import PrefixIndexReplica
from services.processor.metrics import DeciderMetrics, ModelRouterMetrics, ProcessorMetrics, RouterMetrics
from services.processor.model_processors import ModelProcessors
from services.processor.prefill_decider import OUTCOMES, PrefillDecider
from services.common.rpc.convert import generate_delta_to_proto, generate_request_from_proto
from services.processor.processor import Processor
from services.processor.router import REASONS
from services.processor.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_PORT, DEFAULT_METRICS_PORT = DEFAULT_PORTS["processor"]
DEFAULT_ENGINE_ADDRESS = default_address("engine")
SERVICE_NAME = service_name(processor_pb2.DESCRIPTOR, "Processor")
HEALTH_INTERVAL = 1.0  # seconds between checks of the engine's health
ENV_PREFIX = "KVMESH_PROCESSOR"  # KVMESH_PROCESSOR_PORT for --port, ...
ENGINES_FROM_INDEX_INTERVAL = 2.0  # seconds between polls of the index's live engines


class ProcessorServicer(processor_pb2_grpc.ProcessorServicer):
    """Converts proto <-> core and calls the processor core; its errors (and its engine's, which
    pass through) end the call with their status (services/common/errors.py)."""

    def __init__(self, processor: ProcessorClient) -> None:
        self.processor = processor

    @answers_with_status
    async def Generate(self, request: processor_pb2.GenerateRequest, context):
        # A cancelled call (the gateway's client went away) cancels this coroutine at an await;
        # closing the stream then aborts the request's engine requests.
        async with aclosing(self.processor.generate(generate_request_from_proto(request))) as stream:
            async for delta in stream:
                yield generate_delta_to_proto(delta)

    @answers_with_status
    async def Tokenize(self, request: processor_pb2.TokenizeRequest, context):
        return convert.tokenized_to_proto(await self.processor.tokenize(convert.tokenize_request_from_proto(request)))

    @answers_with_status
    async def Detokenize(self, request: processor_pb2.DetokenizeRequest, context):
        return processor_pb2.DetokenizeResponse(text=await self.processor.detokenize(list(request.token_ids),
                                                                                    request.model))

    @answers_with_status
    async def GetTokenizerInfo(self, request: processor_pb2.GetTokenizerInfoRequest, context):
        return processor_pb2.TokenizerInfo(config_json=json.dumps(await self.processor.tokenizer_info(request.model)))

    @answers_with_status
    async def GetModelInfo(self, request: processor_pb2.GetModelInfoRequest, context):
        return convert.engine_info_to_proto(await self.processor.model_info(request.model))

    @answers_with_status
    async def LoadLoRAAdapter(self, request: processor_pb2.LoadLoRAAdapterCall, context):
        await self.processor.load_lora_adapter(request.adapter.lora_name, request.adapter.lora_path,
                                               request.base_model_name)
        return engine_pb2.LoadLoRAAdapterResponse()

    @answers_with_status
    async def UnloadLoRAAdapter(self, request: engine_pb2.UnloadLoRAAdapterRequest, context):
        await self.processor.unload_lora_adapter(request.lora_name)
        return engine_pb2.UnloadLoRAAdapterResponse()


async def wait_for_engine(engine: EngineClient, timeout: float) -> EngineInfo:
    """The engine's info, once one answers (it may come up, or be discovered, after us); TimeoutError
    after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await engine.info()
        except (ConnectionError, TimeoutError) as exc:  # not up (or none discovered) yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"no engine answered in {timeout}s: {exc}") from exc
        await asyncio.sleep(0.5)


class Routing(NamedTuple):
    """What an EngineSet routes by: the policy, the shared index (if any) and the router's metrics."""

    config: RoutingConfig = RoutingConfig()
    index: PrefixIndexConfig = PrefixIndexConfig()
    metrics: RouterMetrics | None = None
    disaggregation: DisaggregationConfig = DisaggregationConfig()  # prefill engines and the threshold
    decider_metrics: DeciderMetrics | None = None

    def metrics_of(self, model: str) -> ModelRouterMetrics | None:
        return None if self.metrics is None else self.metrics.of(model)


@asynccontextmanager
async def open_engines(config: ProcessorServiceConfig, metrics: GrpcMetrics | None = None,
                       security: RpcSecurity = RpcSecurity(), routing: Routing = Routing(),
                       model: str = "") -> AsyncIterator[EngineClient]:
    """The one engine at --engine-address, or an EngineSet over several, over the ready engines of
    --engine-service as they come and go, or over the index's live engines; every connection carries
    `security`'s token (and mTLS). With --prefix-index, its expired engines are swept meanwhile.
    `model`: the served model's name, the router metrics' label."""
    connect = engine_connector(config, metrics, security)
    addresses = engine_addresses(config)
    async with AsyncExitStack() as stack:
        index = await open_routing_index(stack, config, routing.index)
        if len(addresses) == 1:
            engine = connect(addresses[0])
            stack.push_async_callback(engine.close)
            yield decide_prefill(engine, routing)
            return
        engines = EngineSet(config.engine_service or "engines", connect, routing.config, index,
                            routing.index.prefix_index_timeout, routing.metrics_of(model))
        stack.push_async_callback(engines.close)
        await follow_engines(stack, config, index, engines.update, security)
        yield decide_prefill(engines, routing)


@asynccontextmanager
async def open_model_engines(config: ProcessorServiceConfig, models: Sequence[str], metrics: GrpcMetrics | None = None,
                             security: RpcSecurity = RpcSecurity(),
                             routing: Routing = Routing()) -> AsyncIterator[dict[str, EngineClient]]:
    """Each served model's engines by its name. One model: open_engines (every engine found is its).
    Several: an EngineSet per model over the one discovery, each engine in the pool of the model it
    says it serves (services/processor/engine_pools.py)."""
    if len(models) == 1:
        async with open_engines(config, metrics, security, routing, models[0]) as engine:
            yield {models[0]: engine}
        return
    if routing.disaggregation.prefill_engine_address:
        raise ValueError("disaggregated prefill/decode serves one model: give one --model with "
                         "--prefill-engine-address")
    connect = engine_connector(config, metrics, security)
    async with AsyncExitStack() as stack:
        index = await open_routing_index(stack, config, routing.index)
        pools = EnginePools({model: EngineSet(f"{config.engine_service or 'engines'} of {model}", connect,
                                              routing.config, index, routing.index.prefix_index_timeout,
                                              routing.metrics_of(model))
                             for model in models}, lambda address: ask_model_name(connect, address))
        stack.push_async_callback(pools.close)
        await follow_engines(stack, config, index, pools.update, security)
        yield dict(pools.pools)


async def ask_model_name(connect: Callable[[str], EngineClient], address: str) -> str:
    """The model name the engine at `address` serves, asked on a channel of its own."""
    engine = connect(address)
    try:
        return (await engine.info()).model_name
    finally:
        await engine.close()


def engine_connector(config: ProcessorServiceConfig, metrics: GrpcMetrics | None,
                     security: RpcSecurity) -> Callable[[str], GrpcEngineClient]:
    def connect(address: str) -> GrpcEngineClient:
        return GrpcEngineClient(address, timeout=config.engine_timeout, metrics=metrics, security=security)
    return connect


def engine_addresses(config: ProcessorServiceConfig) -> tuple[str, ...]:
    """--engine-address, else the default address when no other source of engines is given."""
    if config.engine_address or config.engine_service is not None or config.engines_from_index:
        return config.engine_address
    return (DEFAULT_ENGINE_ADDRESS,)


async def open_routing_index(stack: AsyncExitStack, config: ProcessorServiceConfig,
                             index_config: PrefixIndexConfig) -> PrefixIndexReplica | None:
    """The replica of --prefix-index, started and swept until `stack` closes; None without one."""
    index = open_index(index_config)
    if config.engines_from_index and index is None:
        raise ValueError("--engines-from-index needs --prefix-index")
    if index is not None:
        stack.push_async_callback(index.close)
        await index.check_access(RedisAccess(index_config.prefix_index).redacted_url)
        index.start()
        await stack.enter_async_context(background(sweep_index(index, index_config.heartbeat_ttl)))
    return index


async def follow_engines(stack: AsyncExitStack, config: ProcessorServiceConfig, index: PrefixIndex | None,
                         update: Callable[[frozenset[Endpoint]], None], security: RpcSecurity) -> None:
    """Hands `update` the engines found: --engine-service's ready endpoints as they change, the index's
    live engines (polled), or the --engine-address list once; followed until `stack` closes."""
    if config.engine_service is not None:
        watcher = EndpointWatcher(config.engine_service, kube_configuration(), config.namespace)
        watcher.subscribe(update)
        watcher.start()
        stack.push_async_callback(watcher.close)
    elif config.engines_from_index:
        assert index is not None
        vouch = IndexEngines(config.engine_allowed_address, config.trust_index_engines, security, config.engine_timeout)
        await stack.enter_async_context(background(follow_index_engines(index, update, vouch=vouch)))
    else:
        update(frozenset(Endpoint(address) for address in engine_addresses(config)))


def decide_prefill(decode: EngineClient, routing: Routing) -> EngineClient:
    """The decode engine(s) behind the prefill decider when there are prefill engines."""
    config = routing.disaggregation
    if not config.prefill_engine_address:
        return decode
    return PrefillDecider(decode, config.prefill_engine_address, config.prefill_threshold, routing.decider_metrics,
                          routing.index.prefix_index_timeout)


@asynccontextmanager
async def background(work: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
    """Runs `work` as a task while the block runs; cancels it (and waits for it) at its end."""
    task = asyncio.create_task(work)
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def open_index(config: PrefixIndexConfig) -> PrefixIndexReplica | None:
    """This processor's replica of the Redis index of --prefix-index (lookups from memory, following
    the index's events stream), or None. Start it inside the event loop."""
    if config.prefix_index is None:
        return None
    return PrefixIndexReplica.connect(RedisAccess.load(config), config.prefix_index_timeout,
                                      config.prefix_index_namespace, config.heartbeat_ttl)


async def sweep_index(index: PrefixIndex, interval: float) -> None:
    """Clears engines whose heartbeat expired (a dead engine's blocks), every `interval` s; every
    processor does it, which is idempotent."""
    while True:
        await asyncio.sleep(interval)
        try:
            if gone := await index.sweep():
                logger.info("prefix index: swept expired engine(s) %s", ", ".join(gone))
        except ConnectionError as e:
            logger.debug("prefix index sweep failed: %s", e)


async def follow_index_engines(index: PrefixIndex, update: Callable[[frozenset[Endpoint]], None],
                               interval: float = ENGINES_FROM_INDEX_INTERVAL, *,
                               vouch: IndexEngines | None = None) -> None:
    """The index's live engines (their ids are their addresses) go to `update` (an EngineSet's, or
    EnginePools'), every `interval` s, those `vouch` vouches for only (None: all, for an index in this
    process); while the index is unreachable the engines known stay."""
    while True:
        try:
            live = await index.engines()
        except ConnectionError as e:
            logger.debug("prefix index unreachable, keeping the engines known: %s", e)
        else:
            ids = frozenset(live) if vouch is None else await vouch.vouched(live)
            update(frozenset(Endpoint(engine_id) for engine_id in ids))
        await asyncio.sleep(interval)


async def follow_engine_health(processor: AsyncProcessor, server: RpcServer, interval: float) -> None:
    serving = True
    while True:
        await asyncio.sleep(interval)
        healthy = await processor.is_healthy()
        if healthy != serving:
            logger.log(logging.INFO if healthy else logging.ERROR, "engine %s: health is %s",
                       "healthy" if healthy else "unhealthy", "SERVING" if healthy else "NOT_SERVING")
            await server.set_serving(healthy)
            serving = healthy


async def serve(models: Sequence[ModelConfig], engines: Mapping[str, EngineClient], serving: ServingConfig,
                startup_timeout: float = 300.0,
                metrics: Callable[[Mapping[str, int]], Mapping[str, ProcessorMetrics]] | None = None,
                security: RpcSecurity = RpcSecurity(),
                tokenizer_threads: int = DEFAULT_TOKENIZER_THREADS,
                grammar_limits: GrammarLimits = GrammarLimits(), *,
                adapters: Mapping[str, str] | None = None) -> None:
    """Serve until SIGTERM/SIGINT. Each model is resolved for its tokenizer only; no weights load.
    The caller owns `engines` (open_model_engines: each served name's engines). `metrics` makes
    each model's metrics once its engines' context lengths (their token buckets' top) are known.
    `adapters`: LoRA adapters by name -> their served base model."""
    # Before waiting for an engine: a bad model or --chat-template fails at once.
    tokenizers = {m.name: load_model_tokenizer(m) for m in models}
    infos = dict(zip([m.name for m in models],
                     await asyncio.gather(*(wait_for_engine(engines[m.name], startup_timeout) for m in models))))
    for name, (_, path) in tokenizers.items():
        if infos[name].model_id != model_id_of(path):
            logger.warning("the engine of %s serves %s, this processor tokenizes for %s", name, infos[name].model_id,
                           model_id_of(path))
    model_metrics = metrics({name: info.max_model_len for name, info in infos.items()}) if metrics is not None else {}
    processor = ModelProcessors({
        name: AsyncProcessor(Processor.for_tokenizer(tokenizer, path, infos[name].max_model_len, grammar_limits),
                             engines[name], model_metrics.get(name), tokenizer_threads)
        for name, (tokenizer, path) in tokenizers.items()}, adapters)
    service_metrics = next(iter(model_metrics.values())).service if model_metrics else None
    interceptors = [service_metrics.grpc.server_interceptor()] if service_metrics is not None else []
    server = RpcServer(serving.host, serving.port, [SERVICE_NAME], interceptors, security, serving.unix_socket)
    processor_pb2_grpc.add_ProcessorServicer_to_server(ProcessorServicer(processor), server.server)
    await server.start()
    health = asyncio.create_task(follow_engine_health(processor, server, HEALTH_INTERVAL))
    await server.wait_for_termination_signal()
    health.cancel()
    await server.shutdown(serving.grace, serving.drain)
    processor.close()


def load_model_tokenizer(model: ModelConfig) -> tuple[PreTrainedTokenizerBase, Path]:
    """`model`'s tokenizer (with --chat-template, if given) and the folder it came from."""
    path = resolve_tokenizer(model.model, model.cache_dir)
    return load_tokenizer(path, model.chat_template), path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh processor", description="The kvmesh processor service.")
    add_flags(parser, ProcessorServiceConfig, ENV_PREFIX)
    add_flags(parser, RoutingConfig, ENV_PREFIX)
    add_flags(parser, PrefixIndexConfig, ENV_PREFIX)
    add_flags(parser, FleetConfig, ENV_PREFIX)
    add_flags(parser, ModelConfig, ENV_PREFIX, only=PROCESSOR_MODEL_FIELDS)
    add_flags(parser, ServingConfig, ENV_PREFIX, defaults={"port": DEFAULT_PORT, "metrics_port": DEFAULT_METRICS_PORT})
    add_flags(parser, SecurityConfig, ENV_PREFIX)
    add_flags(parser, DisaggregationConfig, ENV_PREFIX, only=["prefill_engine_address", "prefill_threshold"])
    add_flags(parser, GrammarLimits, ENV_PREFIX, exclude=GRAMMAR_COMPILE_FIELDS)
    add_flags(parser, LoRAConfig, ENV_PREFIX, only=["enable_lora", "lora_modules"])
    return parser


class ProcessorArgs(NamedTuple):
    service: ProcessorServiceConfig
    model: ModelConfig  # the first model's (the others differ in model and served name only)
    serving: ServingConfig
    security: SecurityConfig = SecurityConfig()
    routing: RoutingConfig = RoutingConfig()
    prefix_index: PrefixIndexConfig = PrefixIndexConfig()
    disaggregation: DisaggregationConfig = DisaggregationConfig()
    grammar_limits: GrammarLimits = GrammarLimits()
    fleet: FleetConfig = FleetConfig()
    adapters: dict[str, str] = {}  # LoRA adapters by name -> their served base model (read only)

    @property
    def models(self) -> tuple[ModelConfig, ...]:
        return self.fleet.model_configs(self.model)


def parse_args(argv: list[str] | None = None) -> ProcessorArgs:
    parser = build_parser()
    args = parser.parse_args(argv)
    service = build(parser, ProcessorServiceConfig, args)
    prefix_index = build(parser, PrefixIndexConfig, args)
    if service.engines_from_index and prefix_index.prefix_index is None:
        parser.error("--engines-from-index needs --prefix-index")
    if service.engine_service is None and not service.engine_address and not service.engines_from_index:
        service = replace(service, engine_address=(DEFAULT_ENGINE_ADDRESS,))
    fleet = build(parser, FleetConfig, args)
    disaggregation = build(parser, DisaggregationConfig, args)
    if len(fleet.model) > 1 and disaggregation.prefill_engine_address:
        parser.error("--prefill-engine-address serves one model: give one --model")
    model = fleet.model_configs(build(parser, ModelConfig, args))[0]
    try:
        adapters = build(parser, LoRAConfig, args).parents(fleet.names)
    except ValueError as exc:
        parser.error(str(exc))
    return ProcessorArgs(service, model, build(parser, ServingConfig, args),
                         build(parser, SecurityConfig, args), build(parser, RoutingConfig, args), prefix_index,
                         disaggregation, build(parser, GrammarLimits, args), fleet, adapters)


def main(argv: list[str] | None = None) -> int:
    parsed = parse_args(argv)
    service, _, serving, security_config, routing, prefix_index, disaggregation, grammar_limits, fleet, _ = parsed
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s processor: %(message)s")
    security = RpcSecurity.load(security_config, PROCESSOR)  # the processor's own port and its calls to engines
    service_metrics = ServiceMetrics.create("processor")
    security.refusals.register(service_metrics.registry)

    def metrics(max_model_lens: Mapping[str, int]) -> dict[str, ProcessorMetrics]:
        return ProcessorMetrics.for_models(service_metrics, max_model_lens)

    async def run() -> None:
        router_metrics = RouterMetrics(service_metrics, routing.routing, REASONS[routing.routing], fleet.names)
        decider_metrics = DeciderMetrics(service_metrics, OUTCOMES) if disaggregation.prefill_engine_address else None
        async with open_model_engines(service, fleet.names, service_metrics.grpc, security,
                                      Routing(routing, prefix_index, router_metrics, disaggregation,
                                              decider_metrics)) as engines:
            await serve(parsed.models, engines, serving, service.startup_timeout, metrics, security,
                        service.tokenizer_threads, grammar_limits, adapters=parsed.adapters)

    endpoint = MetricsEndpoint.start(service_metrics.registry, serving.host, serving.metrics_port)
    try:
        asyncio.run(run())
    finally:
        if endpoint is not None:
            endpoint.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
