"""Start a service as a real subprocess on a free loopback port, wait until it is healthy, and
never leave it behind.

    with running_service(worker_command(model=model_path, port=port), port) as worker:
        ...                       # worker.address == "127.0.0.1:<port>"
    # the whole process group is SIGKILLed on the way out, whatever happened

`worker_command(**fields)` (and engine_, processor_, gateway_command) is `kvmesh worker` with a flag
for each config field given, spelled by to_argv as `kvmesh serve` spells its children's: a field the
service has no flag for is a TypeError here, not a usage error in the child. `running_stack` starts
a worker, its engine and, if asked, a processor and a gateway over them, each dialling the one before.

`health="grpc"` polls the standard grpc.health.v1 Check until SERVING; `health="http"` polls an
HTTP GET (default `/health`) until 200. A process that exits while starting fails at once with
the tail of its log.

`start_serve` runs the whole `kvmesh serve` as a user does (`--print-addresses`), for the session's
shared stack (tests/conftest.py) and for the tests that stop or kill one of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from services.common import processes
from services.common.clients import EngineStats
from services.common.config import SecurityConfig
from services.common.flags import configs_of, to_argv
# The tests take their probes from here.
from services.common.processes import grpc_health_status, grpc_serving, http_ok  # noqa: F401
from services.common.rpc.security import RpcSecurity
from services.common.unix_socket import socket_path
from services.engine import server as engine_server
from services.engine.client import GrpcEngineClient
from services.gateway import server as gateway_server
from services.processor import server as processor_server
from services.worker import server as worker_server
from tests.ports import free_port  # noqa: F401  (the tests take it from here)

if TYPE_CHECKING:  # the client takes ~2 s to import, and the suite's tiers without services never use it
    import openai

REPO_ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
SERVE_KV_CACHE = "128MiB"
SERVE_KV_BYTES = 128 * 2**20
SHARED_MAX_MODEL_LEN = 256  # the context of the session's shared `kvmesh serve` (tests/conftest.py)
SHARED_MODEL_NAME = "smollm2"  # the name it serves its model under


@dataclass
class ServiceProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def terminate(self, timeout: float) -> int:
        """SIGTERM the service itself; its exit code, or TimeoutError if it outlives `timeout`."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"still running {timeout}s after SIGTERM:\n{self.log()}") from None

    def kill(self) -> None:
        """SIGKILL the whole process group (the service and anything it started) and reap it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def start_service(cmd: Sequence[str], port: int, health: str = "grpc", http_path: str = "/health",
                  timeout: float = 180.0, env: Mapping[str, str] | None = None) -> ServiceProcess:
    """Start `cmd` in its own process group (cwd: the repository root) and wait for its health."""
    if health not in ("grpc", "http"):
        raise ValueError(f"health must be 'grpc' or 'http', got {health!r}")
    log = tempfile.NamedTemporaryFile(prefix="kvmesh-service-", suffix=".log", delete=False)
    proc = subprocess.Popen(list(cmd), cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    log.close()
    service = ServiceProcess(proc, port, Path(log.name))
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[:4]} exited with {proc.returncode} while starting:\n{service.log()}")
            if health == "grpc":
                healthy = grpc_serving(service.address)
            else:
                healthy = http_ok(service.url + http_path)
            if healthy:
                return service
            if time.monotonic() > deadline:
                raise TimeoutError(f"{cmd[:4]} not healthy after {timeout}s:\n{service.log()}")
            time.sleep(0.2)
    except BaseException:
        service.kill()
        raise


@contextlib.contextmanager
def running_service(cmd: Sequence[str], port: int, **kwargs) -> Iterator[ServiceProcess]:
    service = start_service(cmd, port, **kwargs)
    try:
        yield service
    finally:
        service.kill()
        service.log_path.unlink(missing_ok=True)


# The configs each service's parser takes flags of (its build_parser), with the same selections.
# Each service's parser (its flags are its configs' fields, services/common/flags.py add_flags).
SERVICE_PARSERS = {"worker": worker_server.build_parser, "engine": engine_server.build_parser,
                   "processor": processor_server.build_parser, "gateway": gateway_server.build_parser}


def service_command(kind: str, *extra: str, **values: Any) -> list[str]:
    """`kvmesh <kind>` with a flag for each of `values` (config fields: `kv_cache_memory=2**27`;
    one value for a repeatable flag's field is one flag), then `extra` as written. The configs are
    built, so a bad value fails here too."""
    argv, left = [], dict(values)
    for config_class, names in configs_of(SERVICE_PARSERS[kind]()):
        given = {f.name: _field_value(f.default, left.pop(f.name)) for f in fields(config_class)
                 if f.name in left and f.name in names}
        if given:
            argv += to_argv(config_class(**given), only=given)
    if left:
        raise TypeError(f"kvmesh {kind} has no flag for {', '.join(sorted(left))}")
    return [PYTHON, "-m", "services.cli", kind, *argv, *extra]


def _field_value(default: object, value: object) -> object:
    """A single value (or a list) for a tuple field becomes a tuple."""
    if isinstance(default, tuple) and not isinstance(value, tuple):
        return tuple(value) if isinstance(value, list) else (value,)
    return value


worker_command = functools.partial(service_command, "worker")
engine_command = functools.partial(service_command, "engine")
processor_command = functools.partial(service_command, "processor")
gateway_command = functools.partial(service_command, "gateway")


@contextlib.contextmanager
def running_kvmesh(kind: str, env: Mapping[str, str] | None = None, **values: Any) -> Iterator[ServiceProcess]:
    """`kvmesh <kind>` with `values` (service_command) on a free port, once healthy; killed on the way out."""
    port = free_port()
    with running_service(service_command(kind, port=port, **values), port,
                         health="http" if kind == "gateway" else "grpc", env=env) as service:
        yield service


class ServiceStack(NamedTuple):
    """What running_stack started, in order (None: not asked for)."""

    worker: ServiceProcess
    engine: ServiceProcess
    processor: ServiceProcess | None
    gateway: ServiceProcess | None


UPSTREAM = {"engine": "worker_address", "processor": "engine_address", "gateway": "processor_address"}


@contextlib.contextmanager
def running_stack(worker: Mapping[str, Any], engine: Mapping[str, Any], processor: Mapping[str, Any] | None = None,
                  gateway: Mapping[str, Any] | None = None) -> Iterator[ServiceStack]:
    """Each service given fields (running_kvmesh) started in order, dialling the one before it: a
    worker, its engine, then a processor and a gateway if given theirs. All killed on the way out."""
    assert processor is not None or gateway is None, "a gateway needs a processor"
    with contextlib.ExitStack() as exits:
        started: list[ServiceProcess] = []
        for kind, values in zip(("worker", "engine", "processor", "gateway"), (worker, engine, processor, gateway)):
            if values is not None:
                upstream = {UPSTREAM[kind]: started[-1].address} if started else {}
                started.append(exits.enter_context(running_kvmesh(kind, **upstream, **values)))
        yield ServiceStack(*started, *[None] * (4 - len(started)))


@dataclass
class Serve:
    """A running `kvmesh serve`: its own process and what it printed about its children."""
    proc: subprocess.Popen
    api: str
    services: dict[str, dict]  # name -> {"address": ..., "pid": ..., "metrics": ...}
    stderr_path: Path

    def log(self, tail: int = 6000) -> str:
        return self.stderr_path.read_text(errors="replace")[-tail:]

    @property
    def url(self) -> str:
        """The API's root: /health, /metrics, /openapi.json."""
        return self.api.removesuffix("/v1")

    @property
    def port(self) -> int:
        """The API's port."""
        return int(self.api.rsplit(":", 1)[1].split("/")[0])

    @property
    def child_pids(self) -> list[int]:
        return [s["pid"] for s in self.services.values()]

    @property
    def token_file(self) -> Path:
        """The gateway's token serve gave it: the file its argv names (only the same user may read
        it; the gateway, which is never restarted on its own). It opens the processor only."""
        argv = Path(f"/proc/{self.services['gateway']['pid']}/cmdline").read_bytes().split(b"\0")
        return Path(argv[argv.index(b"--gateway-token-file") + 1].decode())

    def credential(self, role: str) -> RpcSecurity:
        """What a process of `role` (gateway, processor, engine) sends: serve keeps every role's
        token in one private directory, beside the gateway's."""
        return RpcSecurity.load(SecurityConfig(**{f"{role}_token_file": self.token_file.parent / f"{role}-token"}),
                                role)

    @property
    def security(self) -> RpcSecurity:
        """The processor's credential: the engines' client methods (Generate, GetStats, ...)."""
        return self.credential("processor")

    def engine_stats(self) -> EngineStats:
        async def stats() -> EngineStats:
            client = GrpcEngineClient(self.services["engine"]["address"], timeout=5, security=self.security)
            try:
                return await client.stats()
            finally:
                await client.close()
        return asyncio.run(stats())

    def wait_until_engine_idle(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.engine_stats()
            if stats.num_running == stats.num_waiting == stats.num_used_blocks == 0:
                return
            assert time.monotonic() < deadline, f"the engine still holds requests: {stats}"
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL `kvmesh serve` and every child (each has a process group of its own)."""
        for pid in [self.proc.pid, *self.child_pids]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        self.proc.wait()


def start_serve(model: str | Path, timeout: float = 600.0, extra_args: Sequence[str] = (),
                env: Mapping[str, str] | None = None) -> Serve:
    """`kvmesh serve --model <model>` in float32 (the `served_model` fixture's, for most tests);
    `extra_args` go to `kvmesh serve`; `env` is added to the environment of every service."""
    port = free_port()
    started = processes.start_serve(["--model", str(model), "--dtype", "float32", "--port", str(port),
                                     "--kv-cache-memory", SERVE_KV_CACHE, *extra_args], timeout, env, REPO_ROOT)
    assert started.ready.api == f"http://127.0.0.1:{port}/v1"
    return Serve(started.proc, started.ready.api, started.ready.services, started.stderr)


@contextlib.contextmanager
def running_serve(model: str | Path, **kwargs) -> Iterator[Serve]:
    serve = start_serve(model, **kwargs)
    try:
        yield serve
    finally:
        serve.kill()


def serving(model: str | Path, extra_args: Sequence[str] = ()) -> Iterator[Serve]:
    """`kvmesh serve` for a module-scoped fixture (`yield from serving(...)`), killed at its end."""
    with running_serve(model, extra_args=extra_args) as serve:
        yield serve


@contextlib.contextmanager
def gateway_over(serve: Serve, extra_args: Sequence[str] = ()) -> Iterator[Serve]:
    """A gateway of its own, with `extra_args`, in front of `serve`'s processor: for a module that
    changes only gateway flags, in seconds instead of a whole stack. What it yields is `serve` seen
    through that gateway: its API, its pid under "gateway", its log."""
    port = free_port()
    argv = gateway_command(*extra_args, processor_address=serve.services["processor"]["address"],
                           gateway_token_file=serve.token_file, served_model_name=SHARED_MODEL_NAME,
                           host="127.0.0.1", port=port)
    with running_service(argv, port, health="http", http_path="/health") as gateway:
        services = {**serve.services, "gateway": {"address": gateway.address, "pid": gateway.proc.pid,
                                                  "metrics": f"{gateway.url}/metrics"}}
        yield Serve(serve.proc, f"{gateway.url}/v1", services, gateway.log_path)


def child_processes(parent: int) -> list[tuple[int, list[str]]]:
    """(pid, argv) of each process whose parent is `parent`; one that ends meanwhile is left out."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = [a.decode() for a in (entry / "cmdline").read_bytes().split(b"\0")]
        except (OSError, ValueError):
            continue
        if ppid == parent:
            found.append((int(entry.name), argv))
    return found


def serve_child_pid(serve: Serve, name: str) -> int:
    """The pid of `kvmesh serve`'s current child `name` ("engine", "worker-1", "gateway", ...; it
    changes with each restart): the `kvmesh <service>` under it whose argv names that child's socket."""
    address = serve.services[name].get("address", "")
    path = socket_path(address) if address.startswith("unix:") else None
    for pid, argv in child_processes(serve.proc.pid):
        if argv[2:4] == ["services.cli", name.split("-")[0]] and (path is None or str(path) in argv):
            return pid
    raise LookupError(f"no {name} under kvmesh serve:\n{serve.log()}")


def gone(pid: int) -> bool:
    """No such process, or a zombie (exited; only the reaping is left)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def greedy_token_ids(serve: Serve, model: str, prompt: str | list[int], max_tokens: int) -> list[int]:
    """The token ids of `serve`'s greedy completion of `prompt` by `model` (a model or adapter name),
    EOS ignored; the answer must name the model asked for."""
    import openai

    with openai.OpenAI(base_url=serve.api, api_key="unused", timeout=120, max_retries=0) as client:
        completion = client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert completion.model == model
    return [int(t.removeprefix("token_id:")) for t in completion.choices[0].logprobs.tokens]


def client_for(serve: Serve, timeout: float = 120.0) -> tuple[openai.OpenAI, str]:
    """The `openai` client on `serve` and the one model it serves."""
    import openai

    client = openai.OpenAI(base_url=serve.api, api_key="unused", timeout=timeout, max_retries=0)
    return client, client.models.list().data[0].id
