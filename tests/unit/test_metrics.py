"""The shared metrics pieces without a model: merging several processes' pages into one page
(checked by Prometheus' own promtool), and the gRPC interceptors on a real server and real
channels on loopback, counted by final status code."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics import GrpcMetrics, Scrape, build_1_2_5_buckets, merge_scrapes, new_registry
from services.common.rpc.server import RpcServer


def samples(page: bytes | str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = page.decode() if isinstance(page, bytes) else page
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def assert_valid_exposition(page: bytes) -> None:
    """promtool, Prometheus' own checker, parses it: exit 1 on a family declared twice or a malformed
    line; 3 only for lint advice (vLLM's names have a colon, which it advises against)."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian's prometheus package) is needed; `make setup` installs it"
    check = subprocess.run([promtool, "check", "metrics"], input=page, capture_output=True)
    output = (check.stdout + check.stderr).decode()
    assert check.returncode in (0, 3) and "error" not in output, output


def page_of(component: str, tokens: float) -> str:
    registry = new_registry(component)
    counter = Counter("vllm:generation_tokens", "tokens", ["model_name", "engine"], registry=registry)
    if component == "engine":
        counter.labels("m", "0").inc(tokens)
    return generate_latest(registry).decode()


def test_merged_pages_are_one_valid_exposition_with_distinct_series():
    gateway, engine = page_of("gateway", 0), page_of("engine", 3)
    merged = merge_scrapes([Scrape("gateway", gateway), Scrape("http://127.0.0.1:1/metrics", engine)])
    text = merged.decode()
    assert_valid_exposition(merged)
    assert text.count("# TYPE process_resident_memory_bytes ") == 1
    assert text.count("# TYPE vllm:generation_tokens_total ") == 1
    values = samples(merged)
    # process_* of both processes, told apart by the component the merge added.
    memory = {dict(labels)["component"] for name, labels in values if name == "process_resident_memory_bytes"}
    assert memory == {"gateway", "engine"}
    # vLLM's series keep vLLM's labels: no component.
    tokens = {labels: v for (name, labels), v in values.items() if name == "vllm:generation_tokens_total"}
    assert tokens == {(("engine", "0"), ("model_name", "m")): 3.0}
    build = {dict(labels)["component"] for name, labels in values if name == "kvmesh_build_info"}
    assert build == {"gateway", "engine"}


def test_a_series_two_pages_carry_is_kept_once():
    engine = page_of("engine", 2)
    values = samples(merge_scrapes([Scrape("a", engine), Scrape("a", engine)]))
    assert sum(1 for name, _ in values if name == "vllm:generation_tokens_total") == 1


def test_engines_of_one_serve_stay_apart_by_instance():
    """`kvmesh serve --num-engines 2`: two engine pages with the same labels, from two ports."""
    first, second = page_of("engine", 2), page_of("engine", 5)
    merged = merge_scrapes([Scrape("gateway", page_of("gateway", 0)), Scrape("http://127.0.0.1:1/metrics", first),
                            Scrape("http://127.0.0.1:2/metrics", second)])
    assert_valid_exposition(merged)
    values = samples(merged)
    tokens = {dict(labels)["instance"]: v for (name, labels), v in values.items()
              if name == "vllm:generation_tokens_total"}
    assert tokens == {"127.0.0.1:1": 2.0, "127.0.0.1:2": 5.0}
    build = {(dict(labels)["component"], dict(labels).get("instance")) for name, labels in values
             if name == "kvmesh_build_info"}
    assert build == {("gateway", None), ("engine", "127.0.0.1:1"), ("engine", "127.0.0.1:2")}


def test_1_2_5_buckets_are_vllms():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(8192)[-1] == 5000



@pytest.mark.anyio
async def test_grpc_calls_are_counted_by_final_code_on_both_sides():
    registry = CollectorRegistry()
    metrics = GrpcMetrics(registry, "test")
    server = RpcServer("127.0.0.1", 0, [], [metrics.server_interceptor()])
    await server.start()
    address = f"127.0.0.1:{server.port}"
    channel = grpc.aio.insecure_channel(address, interceptors=metrics.aio_client_interceptors())
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        await stub.Check(health_pb2.HealthCheckRequest())
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Check(health_pb2.HealthCheckRequest(service="no-such-service"))
        watch = stub.Watch(health_pb2.HealthCheckRequest())
        async for _ in watch:
            break
        watch.cancel()  # the client leaves a server stream: CANCELLED on both sides

        def blocking_check() -> None:
            with metrics.intercept_channel(grpc.insecure_channel(address)) as sync_channel:
                health_pb2_grpc.HealthStub(sync_channel).Check(health_pb2.HealthCheckRequest())
        await asyncio.to_thread(blocking_check)

        def counts() -> dict[tuple[str, str, str], float]:
            return {(name, dict(labels)["grpc_method"], dict(labels)["grpc_code"]): value
                    for (name, labels), value in samples(generate_latest(registry)).items()
                    if name.endswith("_handled_total")}
        expected = {
            ("kvmesh_grpc_server_handled_total", "Check", "OK"): 2.0,
            ("kvmesh_grpc_server_handled_total", "Check", "NOT_FOUND"): 1.0,
            ("kvmesh_grpc_server_handled_total", "Watch", "CANCELLED"): 1.0,
            ("kvmesh_grpc_client_handled_total", "Check", "OK"): 2.0,
            ("kvmesh_grpc_client_handled_total", "Check", "NOT_FOUND"): 1.0,
            ("kvmesh_grpc_client_handled_total", "Watch", "CANCELLED"): 1.0,
        }
        for _ in range(100):  # the server side of the cancelled stream ends a moment later
            if counts() == expected:
                break
            await asyncio.sleep(0.02)
        assert counts() == expected
        durations = {dict(labels)["grpc_method"]: value for (name, labels), value in
                     samples(generate_latest(registry)).items() if name == "kvmesh_grpc_server_handling_seconds_count"}
        assert durations == {"Check": 3.0, "Watch": 1.0}
    finally:
        await channel.close()
        await server.shutdown(0)
