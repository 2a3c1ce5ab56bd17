"""The engine service: scheduler, KV-cache manager and prefix cache driving a worker, or a
tensor-parallel group of workers, over gRPC.

    python -m services.engine.server --worker-address 127.0.0.1:50053 --port 50052
    python -m services.engine.server --tensor-parallel-size 2 \
        --worker-address 127.0.0.1:50053 --worker-address 127.0.0.1:50054   # ranks 0 and 1
    python -m services.engine.server --worker-service kvmesh-worker    # in Kubernetes: pod kvmesh-engine-N
                                                                       # pairs with kvmesh-worker-N (TP 1)
                                                                       # or kvmesh-worker-N-0..R (TP R+1)

config -> GrpcWorkerClient per rank -> GroupWorkerClient (blocking; the engine-loop thread calls
it; services/engine/executor.py) -> AsyncEngine ->
EngineServicer -> grpc.aio server (+ health, reflection) -> SIGTERM -> NOT_SERVING -> drain ->
stop(grace) -> engine shutdown. Health follows the engine: NOT_SERVING as soon as one of its workers
fails (gone, stuck, or a failed step), and the process exits 1 after --exit-grace, so that its
supervisor restarts it with all its workers.
The block size is the worker's (WorkerInfo). Flags come from services/common/config.py
(EngineServiceConfig, SchedulerConfig, ServingConfig, PrefixIndexConfig); each falls back to
KVMESH_ENGINE_<FIELD> (KVMESH_ENGINE_PORT, KVMESH_ENGINE_WORKER_ADDRESS, ...).

In a fleet the engine is named by its --advertise-address (default: --host:<bound port>, a wildcard
host replaced by this machine's IP; unix:<path> with --unix-socket) and an epoch (its start time
in ns), both in GetInfo. With --prefix-index it publishes its prefix cache there
(services/engine/kv_publisher.py) and clears itself from it at SIGTERM, before draining; without,
its block pool records no events at all.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import aclosing
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import grpc


from services.common.clients import EngineClient
from services.common.config import (
    DisaggregationConfig,
    EngineServiceConfig,
    GATEWAY_LORA_FIELDS,
    GrammarLimits,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    PrefixIndexConfig,
    SchedulerConfig,
    SecurityConfig,
    ServingConfig,
)
from services.common.flags import add_flags, build
from services.common.lora import check_adapter
from services.common.discovery import EndpointWatcher, kube_configuration
from services.common.errors import answers_with_status
from services.common.metrics import MetricsEndpoint, ServiceMetrics
from services.common.ports import DEFAULT_PORTS, default_address
from services.common.rpc import convert
from services.common.rpc.kvmesh.v1 import engine_pb2, engine_pb2_grpc
from services.common.rpc.security import ENGINE, RpcSecurity
from services.common.rpc.server import RpcServer, service_name
from services.common.unix_socket import unix_address
from services.engine.async_engine import AsyncEngine, EngineIdentity
from services.engine.client import GrpcEngineClient
from services.engine.disaggregation import Disaggregation, Timeouts
from services.engine.kv_event_queue import KVEventQueue
from services.engine.kv_publisher import KVPublisher
from services.engine.executor import GroupWorkerClient
from services.engine.metrics import DisaggregationMetrics, EngineLabels, EngineMetrics, PublisherMetrics
from services.prefix_index import RedisPrefixIndex
from services.prefix_index.redis_index import RedisAccess
from services.worker.client import GrpcWorkerClient

logger = logging.getLogger(__name__)

DEFAULT_PORT, DEFAULT_METRICS_PORT = DEFAULT_PORTS["engine"]
DEFAULT_WORKER_ADDRESS = default_address("worker")
ENV_PREFIX = "KVMESH_ENGINE"  # KVMESH_ENGINE_PORT for --port, ...
SERVICE_NAME = service_name(engine_pb2.DESCRIPTOR, "Engine")


class EngineServicer(engine_pb2_grpc.EngineServicer):
    """Converts proto <-> core and calls the engine; its errors end the call with their status
    (services/common/errors.py)."""

    def __init__(self, engine: EngineClient, security: RpcSecurity = RpcSecurity(), engine_id: str = "") -> None:
        self.engine = engine
        self.security = security  # the tokens it proves it holds (ProveIdentity)
        self.engine_id = engine_id

    @answers_with_status
    async def Generate(self, request: engine_pb2.EngineRequest, context):
        # A cancelled call (the caller went away) cancels this coroutine at an await; closing the
        # stream then aborts the request in the engine.
        async with aclosing(self.engine.generate(convert.engine_request_from_proto(request))) as stream:
            async for output in stream:
                yield convert.engine_output_to_proto(output)

    @answers_with_status
    async def Abort(self, request: engine_pb2.AbortRequest, context) -> engine_pb2.AbortResponse:
        await self.engine.abort(list(request.request_ids))
        return engine_pb2.AbortResponse()

    @answers_with_status
    async def GetStats(self, request: engine_pb2.GetStatsRequest, context) -> engine_pb2.EngineStats:
        return convert.engine_stats_to_proto(await self.engine.stats())

    @answers_with_status
    async def GetInfo(self, request: engine_pb2.GetEngineInfoRequest, context) -> engine_pb2.EngineInfo:
        return convert.engine_info_to_proto(await self.engine.info())

    @answers_with_status
    async def Prefill(self, request: engine_pb2.PrefillRequest, context):
        disaggregation = disaggregation_of(self.engine)
        if disaggregation is None:
            raise ValueError("this engine takes no part in KV transfers: start its workers with --kv-transfer-address")
        async with aclosing(disaggregation.prefill(convert.prefill_task_from_proto(request))) as stream:
            async for progress in stream:
                yield convert.prefill_progress_to_proto(progress)

    @answers_with_status
    async def ReleaseTransfer(self, request: engine_pb2.ReleaseTransferRequest,
                              context) -> engine_pb2.ReleaseTransferResponse:
        disaggregation = disaggregation_of(self.engine)
        if disaggregation is not None:
            await disaggregation.release(request.request_id)
        return engine_pb2.ReleaseTransferResponse()

    @answers_with_status
    async def ProveIdentity(self, request: engine_pb2.IdentityChallenge, context) -> engine_pb2.IdentityProof:
        try:
            proof = self.security.prove(request.nonce, request.role, self.engine_id)
        except LookupError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return engine_pb2.IdentityProof(engine_id=self.engine_id, proof=proof)

    @answers_with_status
    async def MatchPrefix(self, request: engine_pb2.MatchPrefixRequest, context) -> engine_pb2.MatchPrefixResponse:
        return convert.prefix_match_to_proto(await self.engine.match_prefix(convert.block_hashes_from_proto(request)))

    @answers_with_status
    async def LoadLoRAAdapter(self, request: engine_pb2.LoadLoRAAdapterRequest,
                              context) -> engine_pb2.LoadLoRAAdapterResponse:
        await self.engine.load_lora_adapter(request.lora_name, request.lora_path)
        return engine_pb2.LoadLoRAAdapterResponse()

    @answers_with_status
    async def UnloadLoRAAdapter(self, request: engine_pb2.UnloadLoRAAdapterRequest,
                                context) -> engine_pb2.UnloadLoRAAdapterResponse:
        await self.engine.unload_lora_adapter(request.lora_name)
        return engine_pb2.UnloadLoRAAdapterResponse()


def disaggregation_of(engine: EngineClient) -> Disaggregation | None:
    """The disaggregated prefill an in-process engine takes part in, if any: an engine only knows
    it as RemotePrefill (services/engine/async_engine.py), its servicer needs its prefill side too."""
    disaggregation = engine.disaggregation if isinstance(engine, AsyncEngine) else None
    return disaggregation if isinstance(disaggregation, Disaggregation) else None


async def follow_engine_health(engine: AsyncEngine, server: RpcServer, exit_grace: float = 1.0) -> None:
    """Once the engine is dead (it does not recover): NOT_SERVING at once, `exit_grace` seconds for
    open streams to carry their EngineDeadError out, then the server's termination (serve() returns
    False: the process exits non-zero and its supervisor restarts it, with its worker)."""
    await engine.wait_until_unhealthy()
    logger.error("engine dead: health is NOT_SERVING; exiting in %gs", exit_grace)
    await server.set_serving(False)
    await asyncio.sleep(exit_grace)
    server.request_termination()


def engine_identity(advertise_address: str | None, host: str, port: int,
                    unix_socket: Path | None = None) -> EngineIdentity:
    """The engine's id in the prefix index (the address processors reach it at) and a new epoch."""
    if advertise_address is None and unix_socket is not None:
        advertise_address = unix_address(unix_socket)
    if advertise_address is None:
        if host in ("0.0.0.0", "::", "[::]"):  # listening everywhere: name this machine, not a wildcard
            host = socket.gethostbyname(socket.gethostname())
        advertise_address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return EngineIdentity(advertise_address, time.time_ns())


async def start_engine(worker: GroupWorkerClient, args: EngineServiceArgs, metrics: ServiceMetrics,
                       identity: EngineIdentity) -> tuple[AsyncEngine, KVPublisher | None]:
    """The engine, and with --prefix-index its publisher (started); without, no KV event queue at
    all. vLLM's metrics are labelled `model_name` (default: the worker's model id)."""
    index_config = args.prefix_index
    kv_events = KVEventQueue() if index_config.prefix_index is not None else None
    index = await open_index(index_config) if kv_events is not None else None

    def labels(core) -> EngineLabels:
        return EngineLabels(args.model.served_model_name or core.model_id)

    try:
        engine = await AsyncEngine.create(
            worker, args.scheduler, lambda core: EngineMetrics.for_core(metrics.registry, labels(core), core),
            args.service.worker_liveness_interval, kv_events=kv_events, identity=identity,
            grammar_limits=args.grammar_limits, model_name=args.model.served_model_name or "", lora=args.lora)
    except BaseException:
        if index is not None:
            await index.close()
        raise
    enable_disaggregation(engine, worker, args, lambda: DisaggregationMetrics(metrics.registry, labels(engine.core)))
    if index is None:
        return engine, None
    publisher = KVPublisher(index, engine, index_config.heartbeat_ttl,
                            PublisherMetrics(metrics.registry, labels(engine.core)),
                            close_timeout=2 * index_config.prefix_index_timeout)
    publisher.start()
    logger.info("publishing the prefix cache as engine %s (epoch %d)", identity.engine_id, identity.epoch)
    return engine, publisher


async def open_index(config: PrefixIndexConfig) -> RedisPrefixIndex:
    """The index of --prefix-index, its credentials checked before the engine starts: a wrong password
    or certificate fails the start (PermissionError), an unreachable Redis does not."""
    access = RedisAccess.load(config)
    index = RedisPrefixIndex.connect(access, timeout_s=config.prefix_index_timeout,
                                     namespace=config.prefix_index_namespace, heartbeat_ttl_s=config.heartbeat_ttl)
    try:
        await index.check_access(access.redacted_url)
    except PermissionError:
        await index.close()
        raise
    return index


def enable_disaggregation(engine: AsyncEngine, worker: GroupWorkerClient, args: EngineServiceArgs,
                          metrics: Callable[[], DisaggregationMetrics]) -> None:
    """Disaggregated prefill/decode when every worker has a KV-transfer endpoint (its
    metrics registered only then); a prefill or decode role without them is a configuration error."""
    config = args.disaggregation
    endpoints = worker.kv_transfer_endpoints
    if not endpoints:
        if config.engine_role != "both":
            raise ValueError(f"--engine-role {config.engine_role} needs workers started with --kv-transfer-address")
        return
    # Deadlines: the prefill stream gets its own (Disaggregation), unary calls the worker timeout's.
    security = RpcSecurity.load(args.security, ENGINE)

    def connect(address: str) -> GrpcEngineClient:
        return GrpcEngineClient(address, timeout=config.kv_transfer_timeout, security=security)

    timeouts = Timeouts(config.kv_lease, config.remote_prefill_timeout, config.kv_transfer_timeout)
    engine.enable_disaggregation(Disaggregation(engine, worker, connect, config.engine_role, timeouts, metrics()),
                                 endpoints)
    logger.info("disaggregation: role %s, KV-transfer endpoints %s", config.engine_role, ", ".join(endpoints))


async def serve(worker: GroupWorkerClient, args: EngineServiceArgs, metrics: ServiceMetrics,
                security: RpcSecurity = RpcSecurity()) -> bool:
    """Serve until SIGTERM/SIGINT (True) or until the engine dies (False). The workers' client
    deadlines bound the wait for them to come up."""
    serving = args.serving
    # Bound first: the engine's id names the port it got.
    server = RpcServer(serving.host, serving.port, [SERVICE_NAME], [metrics.grpc.server_interceptor()], security,
                       serving.unix_socket)
    identity = engine_identity(args.service.advertise_address, serving.host, server.port, serving.unix_socket)
    engine, publisher = await start_engine(worker, args, metrics, identity)
    engine_pb2_grpc.add_EngineServicer_to_server(EngineServicer(engine, security, identity.engine_id),
                                                 server.server)
    await server.start()
    health = asyncio.create_task(follow_engine_health(engine, server, args.service.exit_grace))
    await server.wait_for_termination_signal()
    health.cancel()
    if publisher is not None:
        await publisher.close()  # out of the index first: routers stop choosing an engine that goes away
    healthy = await engine.is_healthy()
    await server.shutdown(serving.grace if healthy else 0.0, serving.drain if healthy else 0.0)
    disaggregation = disaggregation_of(engine)
    if disaggregation is not None:
        await disaggregation.close()
    await engine.shutdown()
    return healthy


async def discover_workers(service: str, hostnames: Sequence[str], namespace: str | None) -> tuple[str, ...]:
    """The addresses of `service`'s ready endpoints named `hostnames` (in that order), once all are
    ready. The watch ends there: a worker that fails later fails the engine's steps and turns it
    unhealthy (no re-attachment)."""
    watcher = EndpointWatcher(service, kube_configuration(), namespace)
    watcher.start()
    logger.info("waiting for worker(s) %s in service %s/%s", ", ".join(hostnames), watcher.namespace, service)

    def all_ready(ready) -> tuple[str, ...] | None:
        by_name = {e.hostname: e.address for e in ready}
        return tuple(by_name[h] for h in hostnames) if all(h in by_name for h in hostnames) else None

    try:
        addresses = await watcher.wait_for(all_ready)
    finally:
        await watcher.close()
    logger.info("worker(s) at %s", ", ".join(addresses))
    return addresses


def paired_worker_hostnames(engine_hostname: str, tensor_parallel_size: int = 1) -> tuple[str, ...] | None:
    """StatefulSet pods `<release>-engine-N` pair with `<release>-worker-N`, or with a group
    `<release>-worker-N-0` .. `<release>-worker-N-<size-1>` (rank order) when the size is above 1
    (deploy/helm/kvmesh/templates/worker-statefulset.yaml); None for other names."""
    if "-engine-" not in engine_hostname:
        return None
    worker = engine_hostname.replace("-engine-", "-worker-")
    return (worker,) if tensor_parallel_size == 1 else tuple(f"{worker}-{r}" for r in range(tensor_parallel_size))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh engine", description="The kvmesh engine service.")
    add_flags(parser, EngineServiceConfig, ENV_PREFIX)
    add_flags(parser, ParallelConfig, ENV_PREFIX, only=["tensor_parallel_size"])
    add_flags(parser, PrefixIndexConfig, ENV_PREFIX)
    add_flags(parser, SchedulerConfig, ENV_PREFIX)
    add_flags(parser, ModelConfig, ENV_PREFIX, only=["served_model_name"])
    add_flags(parser, ServingConfig, ENV_PREFIX, defaults={"port": DEFAULT_PORT, "metrics_port": DEFAULT_METRICS_PORT})
    add_flags(parser, SecurityConfig, ENV_PREFIX)
    add_flags(parser, GrammarLimits, ENV_PREFIX)
    add_flags(parser, DisaggregationConfig, ENV_PREFIX, only=["engine_role", "kv_lease", "kv_transfer_timeout",
                                                                      "remote_prefill_timeout"])
    add_flags(parser, LoRAConfig, ENV_PREFIX, exclude=["max_cpu_loras", *GATEWAY_LORA_FIELDS])
    return parser


class EngineServiceArgs(NamedTuple):
    service: EngineServiceConfig
    scheduler: SchedulerConfig
    model: ModelConfig
    serving: ServingConfig
    security: SecurityConfig = SecurityConfig()
    prefix_index: PrefixIndexConfig = PrefixIndexConfig()
    parallel: ParallelConfig = ParallelConfig()  # only tensor_parallel_size: the group's size
    disaggregation: DisaggregationConfig = DisaggregationConfig()  # role, lease, transfer timeout
    grammar_limits: GrammarLimits = GrammarLimits()
    lora: LoRAConfig = LoRAConfig()  # the adapters served, refused at start-up when a folder is bad


def parse_args(argv: list[str] | None = None) -> EngineServiceArgs:
    """The engine's configs; the worker's address defaulted or, with --worker-service, the paired
    workers' hostnames found. As many workers as --tensor-parallel-size, or an error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    service = build(parser, EngineServiceConfig, args)
    parallel = build(parser, ParallelConfig, args)
    size = parallel.tensor_parallel_size
    if service.worker_service is None and not service.worker_address:
        if size != 1:
            parser.error(f"--tensor-parallel-size {size} needs {size} --worker-address (one per rank, in rank order)")
        service = replace(service, worker_address=(DEFAULT_WORKER_ADDRESS,))
    elif service.worker_service is not None and not service.worker_hostname:
        hostnames = paired_worker_hostnames(socket.gethostname(), size)
        if hostnames is None:
            parser.error(f"--worker-hostname is needed: this host's name ({socket.gethostname()}) has no -engine-")
        service = replace(service, worker_hostname=hostnames)
    workers = service.worker_address or service.worker_hostname
    if len(workers) != size:
        parser.error(f"{len(workers)} worker(s) given ({', '.join(workers)}) for --tensor-parallel-size {size}: "
                     f"give one per rank, in rank order")
    lora = build(parser, LoRAConfig, args)
    try:  # the worker checks shapes against the model; the folders and ranks are checked here too
        for module in lora.lora_modules:
            check_adapter(module.path, lora.max_lora_rank)
    except ValueError as exc:
        parser.error(str(exc))
    return EngineServiceArgs(service, build(parser, SchedulerConfig, args), build(parser, ModelConfig, args),
                             build(parser, ServingConfig, args), build(parser, SecurityConfig, args),
                             build(parser, PrefixIndexConfig, args), parallel,
                             build(parser, DisaggregationConfig, args), build(parser, GrammarLimits, args), lora)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    service, serving, security_config = args.service, args.serving, args.security
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine: %(message)s")
    security = RpcSecurity.load(security_config, ENGINE)  # the engine's own port and its calls to the worker

    async def run() -> None:
        addresses = service.worker_address or await discover_workers(
            service.worker_service, service.worker_hostname, service.namespace)
        metrics = ServiceMetrics.create("engine")
        security.refusals.register(metrics.registry)
        endpoint = MetricsEndpoint.start(metrics.registry, serving.host, serving.metrics_port)
        # The steps go over each worker's step channel, not gRPC: the hottest call there is, timed by
        # kvmesh_engine_step_rpc_seconds; the workers count theirs by outcome (kvmesh_worker_step_seconds).
        worker = GroupWorkerClient([
            GrpcWorkerClient(address, timeout=service.worker_timeout,
                             liveness_interval=service.worker_liveness_interval,
                             liveness_timeout=service.worker_liveness_timeout, security=security)
            for address in addresses])
        try:
            return await serve(worker, args, metrics, security)
        finally:
            if endpoint is not None:
                endpoint.close()
            worker.close()

    if not asyncio.run(run()):
        logger.error("exiting: a worker of the engine failed (restart the engine with all its workers)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
