"""Service processes on this machine: spawning and supervising them, probing whether they serve,
and `kvmesh serve`'s ready line.

    Supervisor().start([ChildSpec(name, argv, address, ready), ...], timeout)   spawn, wait until ready
    grpc_serving(address) / http_ok(url)                                        is it serving?
    start_serve(flags)                                                          `kvmesh serve`, until ready

Used by `kvmesh serve` (services/cli.py), by the offline LLM's tensor-parallel workers
(services/engine/worker_processes.py), by the tests and by the load tests: one way to start a
service, one way to ask whether it serves, one reader of the ready line.

The children get SIGTERM should their supervisor die without stopping them (Linux's parent-death
signal, which `kvmesh <service>` sets on itself first thing, see services/cli.py: a `preexec_fn`
would make subprocess fork() instead of vfork(), and a fork() of a process whose gRPC health checks
leave gRPC's threads behind can deadlock in gRPC's fork handlers).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from services.common.ports import LOOPBACK
from services.common.rpc.client import health_status
from services.common.rpc.server import SERVING

SERVICE_NAMES = ("worker", "engine", "processor", "gateway")  # what `kvmesh <service>` runs
KILL_AFTER = 1.5  # extra seconds past a grace before SIGKILL
SUPERVISOR_PID_ENV = "KVMESH_SUPERVISOR_PID"  # set by a Supervisor for its children
SERVICE_ENV_PREFIXES = tuple(f"KVMESH_{name.upper()}_" for name in SERVICE_NAMES)
READY_KEY = "kvmesh"  # the ready line is the JSON object whose "kvmesh" is "ready"


class ChildSpec(NamedTuple):
    """A child to start: its name, its service's flags, its address and its readiness check."""

    name: str
    argv: list[str]
    address: str
    ready: Callable[[], bool]


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    address: str
    argv: list[str]
    ready: Callable[[], bool]


def service_of(name: str) -> str:
    """The service a child runs: children are named "<service>" or "<service>-<suffix>" (one of several)."""
    return name.partition("-")[0]


class Supervisor:
    """Children, each `kvmesh <service>` in a process group of its own, started in order and
    stopped in reverse."""

    def __init__(self, grace: float = 5.0, internal_grace: float = 2.0) -> None:
        self.children: list[Child] = []
        self.grace = grace  # the gateway's, for requests in flight
        self.internal_grace = internal_grace  # the others', once the gateway is gone
        self.stop_requested = False

    def request_stop(self, signum: int, frame: object) -> None:
        self.stop_requested = True

    def start(self, stage: Sequence[ChildSpec], timeout: float) -> bool:
        """Start `kvmesh <name> ...` for each child of `stage` at once (a tensor-parallel group's
        workers wait for each other) and wait until each is `ready()`; False if one died, a wait
        timed out or a stop was requested meanwhile (then the caller stops everything)."""
        return self.wait_ready(self.launch(stage), timeout)

    def launch(self, stage: Sequence[ChildSpec]) -> list[Child]:
        """Start each child of `stage` without waiting for it: one that needs no other child to
        start (its imports are the slow part) overlaps with them. `wait_ready` follows it later."""
        children = [Child(name, self._spawn(name, argv), address, argv, ready) for name, argv, address, ready in stage]
        self.children.extend(children)
        return children

    def wait_ready(self, children: Sequence[Child], timeout: float) -> bool:
        """Until every child of `children` is ready (True); False as soon as one exits, when
        `timeout` passes or when a stop is requested."""
        deadline = time.monotonic() + timeout
        waiting = list(children)
        while waiting and not self.stop_requested:
            for child in list(waiting):
                if child.proc.poll() is not None:
                    print(f"kvmesh: the {child.name} exited with code {child.proc.returncode} while starting",
                          file=sys.stderr)
                    return False
                if child.ready():
                    waiting.remove(child)
            if not waiting:
                return True
            if time.monotonic() > deadline:
                names = ", ".join(child.name for child in waiting)
                print(f"kvmesh: not healthy after {timeout:.0f}s: {names}", file=sys.stderr)
                return False
            time.sleep(0.2)
        return not waiting

    def respawn(self, name: str) -> Child:
        """Start the child `name` again with the same flags (same addresses), in place of the old one."""
        index = next(i for i, c in enumerate(self.children) if c.name == name)
        old = self.children[index]
        self.children[index] = Child(name, self._spawn(name, old.argv), old.address, old.argv, old.ready)
        return self.children[index]

    @staticmethod
    def _spawn(name: str, service_argv: list[str]) -> subprocess.Popen:
        # A process group of its own: a Ctrl-C at the terminal reaches only us, and we stop the
        # children in order.
        # Every knob is in the argv: the service's own environment variables would only disagree.
        env = {k: v for k, v in os.environ.items() if not k.startswith(SERVICE_ENV_PREFIXES)}
        return subprocess.Popen([sys.executable, "-m", "services.cli", service_of(name), *service_argv],
                                start_new_session=True, env={**env, SUPERVISOR_PID_ENV: str(os.getpid())})

    def sleep(self, seconds: float) -> None:
        """Until `seconds` passed or a stop was requested."""
        deadline = time.monotonic() + seconds
        while not self.stop_requested and time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def stop(self) -> None:
        """The gateway first (it lets requests in flight finish), then the others together."""
        front = [c for c in self.children if c.name == "gateway"]
        back = [c for c in reversed(self.children) if c.name != "gateway"]
        self._stop(front, self.grace + KILL_AFTER)
        self._stop(back, self.internal_grace + KILL_AFTER)

    @staticmethod
    def _stop(children: list[Child], timeout: float) -> None:
        for child in children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in children:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"kvmesh: the {child.name} did not stop in {timeout:.0f}s; killing it", file=sys.stderr)
        for child in children:
            kill_group(child.proc)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the process group `proc` leads (the service and anything it started), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def free_ports(count: int) -> list[int]:
    """`count` distinct ports the kernel just handed out on loopback (held together, so distinct)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((LOOPBACK, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


# ----------------------------------------------------------------------------- is it serving


def grpc_health_status(address: str, timeout: float = 1.0, service: str = "") -> int | None:
    """The grpc.health.v1 status of `service` ("": the server's overall status) on a plain channel,
    or None when the server cannot be reached. The health service needs no token."""
    with grpc.insecure_channel(address) as channel:
        try:
            return health_status(channel, timeout, service)
        except grpc.RpcError:
            return None


def grpc_serving(address: str, timeout: float = 1.0) -> bool:
    return grpc_health_status(address, timeout) == SERVING


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


# ----------------------------------------------------------------------------- the ready line


class ReadyLine(NamedTuple):
    """What `kvmesh serve --print-addresses` prints once every child serves, one JSON line."""

    api: str  # the OpenAI base URL, http://host:port/v1
    services: dict[str, dict[str, Any]]  # child name -> {"address", "pid", "metrics"}


def format_ready_line(ready: ReadyLine) -> str:
    return json.dumps({READY_KEY: "ready", "api": ready.api, "services": ready.services})


def parse_ready_line(line: str) -> ReadyLine | None:
    """The ready line's content, or None for any other line (a log line, a partial write)."""
    if not line.startswith("{"):
        return None
    try:
        message = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(message, dict) or message.get(READY_KEY) != "ready":
        return None
    return ReadyLine(message["api"], message["services"])


def read_ready_line(path: Path) -> ReadyLine | None:
    """The first ready line written to the file at `path` so far."""
    for line in path.read_text(errors="replace").splitlines():
        ready = parse_ready_line(line)
        if ready is not None:
            return ready
    return None


# ----------------------------------------------------------------------------- kvmesh serve, started


class StartedServe(NamedTuple):
    proc: subprocess.Popen  # `kvmesh serve` itself, the leader of a process group of its own
    ready: ReadyLine
    stdout: Path
    stderr: Path  # where every service logs


def start_serve(flags: Sequence[str], timeout: float = 600.0, env: Mapping[str, str] | None = None,
                cwd: Path | None = None) -> StartedServe:
    """Start `python -m services.cli serve --print-addresses *flags` (with `env` over this process's
    environment) and wait for its ready line; RuntimeError, with serve stopped, if it exits first or
    `timeout` s pass. Its output goes to files, never to a pipe: its children inherit it, and a pipe
    nobody reads stops them at their next log line once 64 KiB are waiting."""
    stdout = Path(tempfile.mkstemp(prefix="kvmesh-serve-", suffix=".out")[1])
    stderr = Path(tempfile.mkstemp(prefix="kvmesh-serve-", suffix=".err")[1])
    with stdout.open("w") as out, stderr.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--print-addresses", *flags],
                                cwd=cwd, stdout=out, stderr=err, start_new_session=True,
                                env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        ready = read_ready_line(stdout)
        if ready is not None:
            return StartedServe(proc, ready, stdout, stderr)
        time.sleep(0.5)
    stop_serve(proc, timeout=10.0)
    raise RuntimeError(f"kvmesh serve did not come up (exit {proc.poll()}); its log, {stderr}, ends:\n"
                       f"{stderr.read_text(errors='replace')[-6000:]}")


def stop_serve(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM (serve stops its children in order), SIGKILL of its group if it does not end in `timeout` s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
    except ProcessLookupError:
        proc.wait()
