"""Each internal caller has its own credential, and each credential opens only what its role calls.

Real worker, engine and processor processes on loopback, started as pods are, each with the role
tokens it holds: the gateway's token (the one on the internet-facing pod) opens the Processor
service and nothing else, so it cannot InitializeCache a worker or Generate on an engine
(PERMISSION_DENIED); the processor's opens the engines' client methods only; the engine's, the
workers and a prefill engine. A token nobody issued is UNAUTHENTICATED everywhere. Every refusal
is counted (kvmesh_rpc_refused_total) without reaching a handler, and the services serve on. An
engine idle for longer than its worker's lease keeps the worker: its idle checks renew the lease.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services import SamplingParams
from services.common.engine_output import EngineCoreRequest
from services.common.errors import InternalError
from services.common.rpc.kvmesh.v1 import engine_pb2, processor_pb2, worker_pb2, worker_pb2_grpc
from services.common.rpc.security import ENGINE, GATEWAY, PROCESSOR, ROLES, RpcSecurity
from services.common.rpc.server import GRPC_OPTIONS
from services.engine.client import GrpcEngineClient
from services.processor.client import GrpcProcessorClient
from services.worker.client import SESSION_METADATA_KEY
from services.worker.step_channel import StepChannel
from tests.faults.test_internal_auth import OPEN_METHODS, call_raw
from tests.services.procs import ServiceProcess, free_port, grpc_health_status, running_stack

pytestmark = pytest.mark.slow

KV_BYTES = 64 * 2**20
OWNER_LEASE = 2.0  # seconds: the worker's; its engine idles for several of them
SERVING = health_pb2.HealthCheckResponse.SERVING
SERVICES = {"worker": worker_pb2.DESCRIPTOR.services_by_name["Worker"],
            "engine": engine_pb2.DESCRIPTOR.services_by_name["Engine"],
            "processor": processor_pb2.DESCRIPTOR.services_by_name["Processor"]}
# What each role may call; every other method of the three services is refused to it.
ALLOWED = {GATEWAY: {"processor": set(SERVICES["processor"].methods_by_name)},
           PROCESSOR: {"engine": {"Generate", "Abort", "GetStats", "GetInfo", "MatchPrefix",
                                "LoadLoRAAdapter", "UnloadLoRAAdapter"}},
           ENGINE: {"worker": set(SERVICES["worker"].methods_by_name),
                    "engine": {"GetInfo", "Prefill", "ReleaseTransfer"}}}


@dataclass
class Stack:
    worker: ServiceProcess
    engine: ServiceProcess
    processor: ServiceProcess
    worker_metrics: str
    credentials: dict[str, RpcSecurity]  # by role


@pytest.fixture(scope="module")
def stack(served_model: str, tmp_path_factory) -> Iterator[Stack]:
    """The three services, each holding only its own role's token and its callers' (as the chart
    mounts them): the worker the engine's, the engine the processor's and its own, the processor
    the gateway's and its own."""
    tokens = tmp_path_factory.mktemp("roles")
    for role in ROLES:
        (tokens / f"{role}-token").write_text(f"the-{role}-token-of-this-test\n")

    def holds(*roles: str) -> dict[str, Path]:
        return {f"{role}_token_file": tokens / f"{role}-token" for role in roles}

    metrics_port = free_port()
    with running_stack(worker=dict(model=served_model, dtype="float32", kv_cache_memory=KV_BYTES, owner_lease=OWNER_LEASE,
                                   metrics_port=metrics_port, **holds(ENGINE)),
                       engine=holds(PROCESSOR, ENGINE),
                       processor=dict(model=served_model, **holds(GATEWAY, PROCESSOR))) as (worker, engine, processor, _):
        credentials = {role: RpcSecurity((tokens / f"{role}-token").read_text().strip(), role=role) for role in ROLES}
        yield Stack(worker, engine, processor, f"http://127.0.0.1:{metrics_port}/metrics", credentials)


def refused_count(stack: Stack, reason: str) -> float:
    page = urllib.request.urlopen(stack.worker_metrics, timeout=10).read().decode()
    prefix = f'kvmesh_rpc_refused_total{{reason="{reason}",service="kvmesh.v1.Worker"}} '
    return next((float(line[len(prefix):]) for line in page.splitlines() if line.startswith(prefix)), 0.0)


def test_each_role_is_refused_every_method_it_does_not_call(stack: Stack):
    """The gateway's token cannot InitializeCache a worker nor Generate on an engine; no role calls
    beyond its own; the refusal comes before any handler (an empty message is never parsed)."""
    before = refused_count(stack, "PERMISSION_DENIED")
    refused = 0
    for role, security in stack.credentials.items():
        for name, service in SERVICES.items():
            denied = [m for m in service.methods
                      if m.name not in ALLOWED[role].get(name, set()) and m.name not in OPEN_METHODS]
            with grpc.insecure_channel(getattr(stack, name).address) as channel:
                codes = {m.name: call_raw(channel, service, m, security.call_metadata) for m in denied}
            assert codes == {m.name: grpc.StatusCode.PERMISSION_DENIED for m in denied}, (role, name)
            refused += len(denied) if name == "worker" else 0
    assert refused_count(stack, "PERMISSION_DENIED") - before == refused  # GATEWAY and PROCESSOR: 4 each
    # A token nobody issued is UNAUTHENTICATED everywhere; health stays open.
    wrong = (("authorization", "Bearer the-token-of-nobody"),)
    for name, service in SERVICES.items():
        with grpc.insecure_channel(getattr(stack, name).address) as channel:
            closed = [m for m in service.methods if m.name not in OPEN_METHODS]
            assert {call_raw(channel, service, m, wrong) for m in closed} == {grpc.StatusCode.UNAUTHENTICATED}
        assert grpc_health_status(getattr(stack, name).address, service=service.full_name) == SERVING
    assert refused_count(stack, "UNAUTHENTICATED") >= len(SERVICES["worker"].methods)


def test_the_step_channel_opens_for_an_engine_token_only(stack: Stack):
    with grpc.insecure_channel(stack.worker.address, options=GRPC_OPTIONS) as channel:
        info = worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetWorkerInfoRequest(), timeout=10,
                                                          metadata=stack.credentials[ENGINE].call_metadata)
    for role in (GATEWAY, PROCESSOR):
        # The worker holds the engine's token only: another's is one it does not know.
        with pytest.raises(InternalError, match="UNAUTHENTICATED"):
            StepChannel.connect("127.0.0.1", info.step_port, stack.credentials[role], "any-session", timeout=10)


def test_each_role_calls_what_it_needs(stack: Stack):
    async def calls() -> None:
        processor = GrpcProcessorClient(stack.processor.address, timeout=30, security=stack.credentials[GATEWAY])
        engine = GrpcEngineClient(stack.engine.address, timeout=10, security=stack.credentials[PROCESSOR])
        try:
            assert (await processor.model_info()).max_model_len > 0
            assert (await engine.stats()).num_total_blocks > 0
            request = EngineCoreRequest(f"roles-{time.monotonic_ns()}", [504, 3458, 282],
                                        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
            assert sum([len(o.new_token_ids) async for o in engine.generate(request)]) == 3
        finally:
            await processor.close()
            await engine.close()
    asyncio.run(calls())


def test_an_idle_engine_keeps_its_worker_past_the_lease(stack: Stack):
    """The engine has been idle since its last request; after several leases' worth of idling a
    new session (with the engine's token, as a second engine pod would have) still cannot take the
    worker over, and the engine serves on."""
    asyncio.run(generate(stack, 2))
    time.sleep(2.5 * OWNER_LEASE)
    intruder = (*stack.credentials[ENGINE].call_metadata, (SESSION_METADATA_KEY, "another-engine"))
    with grpc.insecure_channel(stack.worker.address, options=GRPC_OPTIONS) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            worker_pb2_grpc.WorkerStub(channel).InitializeCache(worker_pb2.InitializeCacheRequest(max_num_reqs=4),
                                                               metadata=intruder, timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    asyncio.run(generate(stack, 4))
    assert grpc_health_status(stack.engine.address) == SERVING


async def generate(stack: Stack, count: int) -> None:
    engine = GrpcEngineClient(stack.engine.address, timeout=10, security=stack.credentials[PROCESSOR])
    request = EngineCoreRequest(f"idle-{time.monotonic_ns()}", [504, 3458, 282],
                                SamplingParams(temperature=0, max_tokens=count, ignore_eos=True))
    try:
        assert sum([len(o.new_token_ids) async for o in engine.generate(request)]) == count
    finally:
        await engine.close()
