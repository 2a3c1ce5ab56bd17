"""`kvmesh serve --num-engines 2` as a user runs it: two worker+engine pairs, each on sockets of its
own, behind one processor and one gateway; a completion goes through; the gateway's /metrics
merges both engines; a dead worker restarts its own pair only, while the other pair serves on.

This module checks what `kvmesh serve` does, not the routing (tests/services/test_fleet.py does). One
`kvmesh serve` for the module; the restart test comes last and leaves it serving."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from services.common.metrics import fetch_page
from tests.services.procs import Serve, client_for, gone, grpc_health_status, serve_child_pid, serving
from tests.unit.test_metrics import samples

PAIRS = (("worker-0", "engine-0"), ("worker-1", "engine-1"))
# A dead worker is noticed in about a second (the defaults are 1 s / 5 s / 1 s).
LIVENESS = ["--worker-liveness-interval", "0.5", "--worker-liveness-timeout", "3", "--exit-grace", "0.5",
            "--restart-backoff", "0.5"]
RECOVERY_SECONDS = 180  # a fresh worker loads the model again; generous for a shared CPU
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def fleet(served_model: str) -> Iterator[Serve]:
    yield from serving(served_model, ["--num-engines", "2", "--max-model-len", "256", *LIVENESS])


def argv_of(pid: int) -> list[str]:
    return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]


def flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]





def complete(serve: Serve) -> str:
    client, model = client_for(serve)
    reply = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
    [choice] = reply.choices
    assert choice.finish_reason in ("length", "stop") and reply.usage.completion_tokens > 0
    return choice.text


def test_two_pairs_on_their_own_sockets_behind_one_processor(fleet: Serve):
    names = {name for pair in PAIRS for name in pair}
    assert set(fleet.services) == names | {"processor", "gateway"}
    addresses = [s["address"] for s in fleet.services.values()]
    metrics = [s["metrics"] for s in fleet.services.values()]
    assert len(set(addresses)) == len(addresses) and len(set(metrics)) == len(metrics)
    engines = []
    for worker, engine in PAIRS:
        argv = argv_of(fleet.services[engine]["pid"])
        assert flag_values(argv, "--worker-address") == [fleet.services[worker]["address"]]
        assert flag_values(argv, "--advertise-address") == [fleet.services[engine]["address"]]
        assert grpc_health_status(fleet.services[engine]["address"]) == SERVING
        engines.append(fleet.services[engine]["address"])
    assert flag_values(argv_of(fleet.services["processor"]["pid"]), "--engine-address") == engines
    assert complete(fleet)

    # One scrape of the gateway shows every internal service, the two engines apart by instance.
    page = samples(fetch_page(fleet.services["gateway"]["metrics"], 10))
    build = {(dict(labels)["component"], dict(labels).get("instance")) for name, labels in page
             if name == "kvmesh_build_info"}
    expected = {(name.split("-")[0], fleet.services[name]["metrics"].split("/")[2]) for name in names}
    assert expected | {("processor", None), ("gateway", None)} == build


def test_a_dead_worker_restarts_only_its_pair(fleet: Serve):
    before = {name: serve_child_pid(fleet, name) for pair in PAIRS for name in pair}
    os.kill(before["worker-1"], signal.SIGKILL)
    # The other pair serves on meanwhile (the processor sends everything to engine-0).
    assert complete(fleet)
    deadline = time.monotonic() + RECOVERY_SECONDS
    while "worker-1 and engine-1 are serving again" not in fleet.log():
        assert fleet.proc.poll() is None, fleet.log()
        assert time.monotonic() < deadline, f"pair 1 did not come back:\n{fleet.log()}"
        assert grpc_health_status(fleet.services["engine-0"]["address"]) == SERVING
        time.sleep(0.5)
    after = {name: serve_child_pid(fleet, name) for name in before}
    assert gone(before["worker-1"]) and gone(before["engine-1"])
    assert after["worker-1"] != before["worker-1"] and after["engine-1"] != before["engine-1"]
    assert {n: after[n] for n in PAIRS[0]} == {n: before[n] for n in PAIRS[0]}  # pair 0 untouched
    assert "restarting worker-1 and engine-1" in fleet.log() and "worker-0 and engine-0" not in fleet.log()
    assert grpc_health_status(fleet.services["engine-1"]["address"]) == SERVING  # the same address
    assert complete(fleet)
