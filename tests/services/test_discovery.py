"""Discovery through the Kubernetes API: EndpointWatcher against an API server on loopback, and a
processor that finds its engine (and an engine that finds its worker) that way.

Why a fake API server: no Kubernetes API server can be installed on these machines (no container
runtime, etcd, kind or k3s). tests/services/fake_kube.py serves the EndpointSlice list and watch
endpoints in the API's own wire format (list JSON with resourceVersion, chunked newline-delimited
watch events, 410 Gone as an ERROR event), so what runs here is the real `kubernetes` client, its
urllib3 HTTP, its chunked stream reading and its JSON-to-model parsing, and our watch loop on top.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from kubernetes.client import Configuration

from services.common import discovery
from services.common.clients import EngineStats, GenerateRequest
from services.common.config import RoutingConfig
from services.common.discovery import Backoff, Endpoint, EndpointWatcher, kube_configuration
from services.common.engine_output import EngineCoreRequest
from services.common.rpc.convert import generate_request_to_proto
from services.common.rpc.kvmesh.v1 import processor_pb2_grpc
from services.common.sampling_params import SamplingParams
from services.engine import server as engine_server
from services.engine.client import GrpcEngineClient
from services.processor import server as processor_server
from services.processor.engine_set import EngineSet
from tests.services.fake_kube import FakeKubeApi, endpoint, endpoint_slice
from tests.services.procs import ServiceProcess, free_port, grpc_health_status, running_kvmesh

pytestmark = pytest.mark.anyio

FAST = Backoff(initial=0.02, maximum=0.1)
WAIT = 10.0  # seconds any one change may take to arrive



@pytest.fixture
def api() -> Iterator[FakeKubeApi]:
    with FakeKubeApi() as fake:
        yield fake


@asynccontextmanager
async def watching(api: FakeKubeApi, service: str = "engines",
                   configuration: Configuration | None = None) -> AsyncIterator[tuple[EndpointWatcher, list]]:
    """A started watcher, and every ready set delivered to its subscriber."""
    watcher = EndpointWatcher(service, configuration or Configuration(host=api.url), namespace="test", backoff=FAST)
    delivered: list[frozenset[Endpoint]] = []
    watcher.subscribe(delivered.append)
    watcher.start()
    try:
        yield watcher, delivered
    finally:
        await watcher.close()


async def until(watcher: EndpointWatcher, addresses: set[str]) -> frozenset[Endpoint]:
    """The ready set, once its addresses are exactly `addresses`."""
    def exactly(ready: frozenset[Endpoint]) -> frozenset[Endpoint] | None:
        return ready if {e.address for e in ready} == addresses else None
    try:
        return await asyncio.wait_for(watcher.wait_for(exactly), WAIT)
    except TimeoutError:
        raise AssertionError(f"ready set still {sorted(e.address for e in watcher.endpoints)}, "
                             f"wanted {sorted(addresses)}") from None


# ----------------------------------------------------------------------------- the watcher


async def test_initial_list_is_the_ready_set_of_the_service(api: FakeKubeApi):
    api.apply(endpoint_slice("engines-a", "engines", [
        endpoint("10.0.0.1", hostname="engine-0", pod="engine-0"),
        endpoint("10.0.0.2", ready=False, hostname="engine-1"),
        endpoint("10.0.0.3", ready=None),  # unknown counts as ready
    ], ports={"metrics": 9090, "grpc": 50052}))
    api.apply(endpoint_slice("engines-v6", "engines", [endpoint("fd00::7")], address_type="IPv6"))
    api.apply(endpoint_slice("engines-noport", "engines", [endpoint("10.0.0.9")], ports={"http": 80}))
    api.apply(endpoint_slice("workers-a", "workers", [endpoint("10.0.1.1")]))  # another Service
    list_version = api.apply(endpoint_slice("engines-b", "engines", [endpoint("10.0.2.1")]), namespace="other")
    loop_thread = threading.get_ident()
    threads: list[int] = []

    async with watching(api) as (watcher, delivered):
        watcher.subscribe(lambda ready: threads.append(threading.get_ident()))
        ready = await until(watcher, {"10.0.0.1:50052", "10.0.0.3:50052", "[fd00::7]:50052"})
        assert sorted(ready) == [Endpoint("10.0.0.1:50052", "engine-0", "engine-0"), Endpoint("10.0.0.3:50052"),
                                 Endpoint("[fd00::7]:50052")]
        assert delivered == [ready]  # one delivery for the whole initial list
        assert threads == [loop_thread]  # subscribers run on the event loop, not the watch thread
        for _ in range(100):
            if api.watch_requests():
                break
            await asyncio.sleep(0.02)
    first_list, first_watch = api.list_requests()[0], api.watch_requests()[0]
    assert first_list.namespace == "test" and first_list.label_selector == "kubernetes.io/service-name=engines"
    assert first_watch.resource_version == str(list_version)  # the watch starts where the list ended


async def test_unready_endpoint_leaves_and_new_ones_join(api: FakeKubeApi):
    api.apply(endpoint_slice("engines-a", "engines", [endpoint("10.0.0.1"), endpoint("10.0.0.2")]))
    async with watching(api) as (watcher, delivered):
        await until(watcher, {"10.0.0.1:50052", "10.0.0.2:50052"})
        api.apply(endpoint_slice("engines-a", "engines", [endpoint("10.0.0.1"), endpoint("10.0.0.2", ready=False)]))
        await until(watcher, {"10.0.0.1:50052"})
        api.apply(endpoint_slice("engines-b", "engines", [endpoint("10.0.0.3", hostname="engine-2", pod="engine-2")]))
        ready = await until(watcher, {"10.0.0.1:50052", "10.0.0.3:50052"})
        assert Endpoint("10.0.0.3:50052", "engine-2", "engine-2") in ready
        api.apply(endpoint_slice("engines-a", "engines", [endpoint("10.0.0.1"), endpoint("10.0.0.2")]))
        await until(watcher, {"10.0.0.1:50052", "10.0.0.2:50052", "10.0.0.3:50052"})
        # A change that leaves the ready set as it was is not delivered.
        api.apply(endpoint_slice("engines-b", "engines", [endpoint("10.0.0.3", hostname="engine-2", pod="engine-2"),
                                                          endpoint("10.0.0.4", ready=False)]))
        api.delete("engines-a")
        await until(watcher, {"10.0.0.3:50052"})
        assert [sorted(e.address for e in d) for d in delivered] == [
            ["10.0.0.1:50052", "10.0.0.2:50052"], ["10.0.0.1:50052"], ["10.0.0.1:50052", "10.0.0.3:50052"],
            ["10.0.0.1:50052", "10.0.0.2:50052", "10.0.0.3:50052"], ["10.0.0.3:50052"]]
    assert len(api.list_requests()) == 1  # all of it through one watch


async def test_deleted_slice_takes_its_endpoints_along(api: FakeKubeApi):
    api.apply(endpoint_slice("engines-a", "engines", [endpoint("10.0.0.1")]))
    api.apply(endpoint_slice("engines-b", "engines", [endpoint("10.0.0.2")]))
    async with watching(api) as (watcher, _):
        await until(watcher, {"10.0.0.1:50052", "10.0.0.2:50052"})
        api.delete("engines-a")
        await until(watcher, {"10.0.0.2:50052"})
        api.delete("engines-b")
        assert await until(watcher, set()) == frozenset()


async def test_dropped_watch_resumes_from_the_last_resource_version(api: FakeKubeApi):
    api.apply(endpoint_slice("engines-a", "engines", [endpoint("10.0.0.1")]))
    async with watching(api) as (watcher, _):
        await until(watcher, {"10.0.0.1:50052"})
        last_seen = api.apply(endpoint_slice("engines-a", "engines", [endpoint("10.0.0.1"), endpoint("10.0.0.2")]))
        await until(watcher, {"10.0.0.1:50052", "10.0.0.2:50052"})
        api.drop_watches()
        api.apply(endpoint_slice("engines-b", "engines", [endpoint("10.0.0.3")]))  # while it reconnects
        await until(watcher, {"10.0.0.1:50052", "10.0.0.2:50052", "10.0.0.3:50052"})
    watches = api.watch_requests()
    assert len(watches) == 2 and watches[1].resource_version == str(last_seen)
    assert len(api.list_requests()) == 1  # resumed, not listed again


async def test_expired_watch_lists_again(api: FakeKubeApi):
    """410 Gone: the history to resume from was compacted, so changes in it are only in a new list."""
    api.apply(endpoint_slice("engines-a", "engines", [endpoint("10.0.0.1")]))
    async with watching(api) as (watcher, _):
        await until(watcher, {"10.0.0.1:50052"})
        api.delete("engines-a", compacted=True)
        relisted = api.apply(endpoint_slice("engines-b", "engines", [endpoint("10.0.0.2")]), compacted=True)
        await until(watcher, {"10.0.0.2:50052"})
        lists = api.list_requests()
        assert len(lists) == 2
        for _ in range(100):  # and watches on from the new list
            if api.watch_requests()[-1].resource_version == str(relisted):
                break
            await asyncio.sleep(0.02)
        assert api.watch_requests()[-1].resource_version == str(relisted)
        api.apply(endpoint_slice("engines-c", "engines", [endpoint("10.0.0.3")]))
        await until(watcher, {"10.0.0.2:50052", "10.0.0.3:50052"})


async def test_api_errors_are_retried_with_backoff(api: FakeKubeApi):
    api.apply(endpoint_slice("engines-a", "engines", [endpoint("10.0.0.1")]))
    api.fail(3)
    async with watching(api) as (watcher, _):
        await until(watcher, {"10.0.0.1:50052"})
        assert len(api.list_requests()) == 4  # three 500s, then the list
        seen = len(api.watch_requests())
        api.fail(2)
        api.drop_watches()  # the next two watches get 500, the third resumes
        api.apply(endpoint_slice("engines-b", "engines", [endpoint("10.0.0.2")]))
        await until(watcher, {"10.0.0.1:50052", "10.0.0.2:50052"})
    assert len(api.watch_requests()) - seen == 3
    assert len(api.list_requests()) == 4


async def test_close_cuts_the_open_watch(api: FakeKubeApi):
    async with watching(api) as (watcher, _):
        await until(watcher, set())
        for _ in range(100):
            if api.open_watches:
                break
            await asyncio.sleep(0.02)
        assert api.open_watches == 1
        start = time.monotonic()
    assert time.monotonic() - start < 1.0
    assert not watcher._thread.is_alive()


async def test_kubeconfig_and_namespace_defaults(api: FakeKubeApi, tmp_path: Path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path, api.url)))
    configuration = kube_configuration()
    assert configuration.host == api.url
    api.apply(endpoint_slice("engines-a", "engines", [endpoint("10.0.0.1")]))
    async with watching(api, configuration=configuration) as (watcher, _):
        await until(watcher, {"10.0.0.1:50052"})

    monkeypatch.setattr(discovery, "SERVICE_ACCOUNT_NAMESPACE", tmp_path / "namespace")
    monkeypatch.setenv("KVMESH_NAMESPACE", "from-env")
    assert discovery.default_namespace() == "from-env"
    (tmp_path / "namespace").write_text("from-pod\n")
    assert discovery.default_namespace() == "from-pod"
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="kubeconfig"):
        kube_configuration()


def write_kubeconfig(folder: Path, server: str) -> Path:
    path = folder / "kubeconfig"
    path.write_text(json.dumps({  # JSON is YAML
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "fake", "user": {}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
    }))
    return path


# ----------------------------------------------------------------------------- the engine set


async def test_engine_set_routes_to_the_least_busy_ready_engine():
    """Routing state only: the clients' channels are never dialled (grpc connects on first use)."""
    engines = EngineSet("engines", lambda address: GrpcEngineClient(address, timeout=1.0),
                        RoutingConfig(routing="least-load"))
    request = EngineCoreRequest("r-0", [1, 2, 3], SamplingParams(max_tokens=1))
    try:
        with pytest.raises(ConnectionError, match="no ready engine in service engines"):
            await engines.choose(request)
        assert await engines.stats() == EngineStats(0, 0, 0, 0, 0, 0, 0)  # lora None: no engine has it on
        a, b = Endpoint("127.0.0.1:1", "engine-0"), Endpoint("127.0.0.1:2", "engine-1")
        engines.update(frozenset({a, b}))
        engines.members[a.address].in_flight = 2
        engines.members[b.address].in_flight = 1
        assert (await engines.choose(request)).endpoint == b
        engines.members[b.address].healthy = False  # an unhealthy engine only when nothing else is ready
        assert (await engines.choose(request)).endpoint == a
        assert (await engines.choose(request, exclude=frozenset({a.address}))).endpoint == b
        engines.update(frozenset({b}))  # a turns unready with requests in flight: it drains, gets no more
        assert not engines.members[a.address].ready and (await engines.choose(request)).endpoint == b
        engines.update(frozenset({a, b}))  # back before it drained: the same member, routable again
        assert engines.members[a.address].ready and engines.members[a.address].in_flight == 2
        engines.members[a.address].in_flight = 0
        engines.update(frozenset({b}))  # idle and unready: retired at once
        assert set(engines.members) == {b.address}
    finally:
        await engines.close()


def test_discovery_flags():
    with pytest.raises(SystemExit):
        processor_server.parse_args(["--engine-service", "engines", "--engine-address", "127.0.0.1:1"])
    assert processor_server.parse_args([]).service.engine_address == (processor_server.DEFAULT_ENGINE_ADDRESS,)
    args = processor_server.parse_args(["--engine-service", "engines", "--namespace", "prod"]).service
    assert (args.engine_service, args.engine_address, args.namespace) == ("engines", (), "prod")

    with pytest.raises(SystemExit):
        engine_server.parse_args(["--worker-service", "workers", "--worker-address", "127.0.0.1:1"])
    with pytest.raises(SystemExit):
        engine_server.parse_args(["--worker-hostname", "kvmesh-worker-0"])  # without --worker-service
    assert engine_server.parse_args([]).service.worker_address == (engine_server.DEFAULT_WORKER_ADDRESS,)
    args = engine_server.parse_args(["--worker-service", "workers", "--worker-hostname", "w-0"]).service
    assert (args.worker_address, args.worker_hostname) == ((), ("w-0",))
    assert engine_server.paired_worker_hostnames("kvmesh-engine-3") == ("kvmesh-worker-3",)
    assert engine_server.paired_worker_hostnames("kvmesh-engine-3", 2) == ("kvmesh-worker-3-0", "kvmesh-worker-3-1")
    assert engine_server.paired_worker_hostnames("laptop") is None


def test_an_engine_takes_one_worker_per_rank_in_rank_order():
    args = engine_server.parse_args(["--tensor-parallel-size", "2", "--worker-address", "127.0.0.1:1",
                                     "--worker-address", "127.0.0.1:2"])
    assert (args.parallel.tensor_parallel_size, args.service.worker_address) == (2, ("127.0.0.1:1", "127.0.0.1:2"))
    args = engine_server.parse_args(["--tensor-parallel-size", "2", "--worker-service", "workers",
                                     "--worker-hostname", "w-0-0", "--worker-hostname", "w-0-1"])
    assert args.service.worker_hostname == ("w-0-0", "w-0-1")
    for wrong in (["--tensor-parallel-size", "2"],  # no addresses: the default is one worker
                  ["--tensor-parallel-size", "2", "--worker-address", "127.0.0.1:1"],
                  ["--worker-address", "127.0.0.1:1", "--worker-address", "127.0.0.1:2"],  # size 1
                  ["--tensor-parallel-size", "0", "--worker-address", "127.0.0.1:1"],
                  ["--tensor-parallel-size", "2", "--worker-service", "workers", "--worker-hostname", "w-0-0"]):
        with pytest.raises(SystemExit):
            engine_server.parse_args(wrong)


# ----------------------------------------------------------------------------- end to end


@dataclass
class Stack:
    api: FakeKubeApi
    engine: ServiceProcess
    processor: ServiceProcess


def engine_slice(ready: bool, port: int) -> dict:
    return endpoint_slice("engines-x", "engines", [endpoint("127.0.0.1", ready, "kvmesh-engine-0", "kvmesh-engine-0")],
                          ports={"grpc": port})


@pytest.fixture(scope="module")
def stack(served_model: str, tmp_path_factory) -> Iterator[Stack]:
    """Worker, engine and processor as processes; the engine finds its worker and the processor its
    engine through the fake API server (a kubeconfig names it; KUBERNETES_SERVICE_HOST is cleared so
    that the in-cluster path is not taken even inside a pod)."""
    with FakeKubeApi() as api, ExitStack() as exits:
        env = {"KUBECONFIG": str(write_kubeconfig(tmp_path_factory.mktemp("kube"), api.url)),
               "KUBERNETES_SERVICE_HOST": ""}
        worker = exits.enter_context(running_kvmesh("worker", model=served_model, dtype="float32", metrics_port=0,
                                                    kv_cache_memory=64 * 2**20))
        # The engine must pick its pair by hostname: worker-1 is on a port where nothing listens.
        api.apply(endpoint_slice("workers-y", "workers", [endpoint("127.0.0.1", True, "kvmesh-worker-1")],
                                 ports={"grpc": free_port()}))
        api.apply(endpoint_slice("workers-x", "workers", [endpoint("127.0.0.1", True, "kvmesh-worker-0")],
                                 ports={"grpc": worker.port}))
        engine = exits.enter_context(running_kvmesh("engine", env, worker_service="workers", namespace="test",
                                                    worker_hostname="kvmesh-worker-0", metrics_port=0))
        api.apply(engine_slice(True, engine.port))
        processor = exits.enter_context(running_kvmesh("processor", env, model=served_model, engine_service="engines",
                                                       namespace="test", metrics_port=0, engine_timeout=2))
        yield Stack(api, engine, processor)


def generate(address: str, request_id: str) -> list[int]:
    """Token ids of one short greedy completion through the processor's Generate."""
    request = GenerateRequest(request_id, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                              prompt="The capital of France is")
    with grpc.insecure_channel(address) as channel:
        deltas = processor_pb2_grpc.ProcessorStub(channel).Generate(generate_request_to_proto(request), timeout=60)
        return [t for delta in deltas for choice in delta.choices for t in choice.token_ids]


def wait_for_health(address: str, status: int, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while (now := grpc_health_status(address)) != status:
        assert time.monotonic() < deadline, f"health still {now}, wanted {status}"
        time.sleep(0.1)


def test_processor_follows_its_engine_through_the_api(stack: Stack):
    tokens = generate(stack.processor.address, "discovered-0")
    assert len(tokens) == 4

    stack.api.apply(engine_slice(False, stack.engine.port))  # the engine turns unready
    wait_for_health(stack.processor.address, health_pb2.HealthCheckResponse.NOT_SERVING)
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as failed:
        generate(stack.processor.address, "discovered-1")
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
    assert "no ready engine" in failed.value.details()
    assert time.monotonic() - start < 2.0, "with no ready engine, requests fail fast"

    stack.api.apply(engine_slice(True, stack.engine.port))  # ready again
    wait_for_health(stack.processor.address, health_pb2.HealthCheckResponse.SERVING)
    assert generate(stack.processor.address, "discovered-2") == tokens
