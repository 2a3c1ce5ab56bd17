"""The `kvmesh` command.

    kvmesh serve [--model smollm2] [--host 127.0.0.1] [--port 8000] ...   all services on this machine
    kvmesh worker|engine|processor|gateway --...                           one service (a pod's entry point)

`kvmesh serve` starts worker, engine, processor and gateway as separate processes, the internal
ones on free loopback ports, each after the one before it is healthy; prints where the API is;
then supervises them. On Ctrl-C or SIGTERM, or when one of them dies, it stops them all, the
gateway first so that requests in flight can finish, then the rest; SIGKILL after a grace. The
children get SIGTERM should this process die without stopping them (Linux's parent-death signal,
which each child sets on itself first thing: a `preexec_fn` would make subprocess fork() instead of
vfork(), and a fork() of this process, whose gRPC health checks leave gRPC's threads behind, can
deadlock in gRPC's fork handlers).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import ATTENTION_BACKENDS, DEFAULT_MAX_NUM_WAITING, DTYPES
from services.gateway.limits import Limits

SERVICES = {
    "worker": "services.worker.server",
    "engine": "services.engine.server",
    "processor": "services.processor.server",
    "gateway": "services.gateway.server",
}
USAGE = """usage: kvmesh <command> [flags]

commands:
  serve       run worker, engine, processor and gateway on this machine (kvmesh serve --help)
  worker      run the worker service (kvmesh worker --help)
  engine      run the engine service
  processor   run the processor service
  gateway     run the OpenAI-compatible HTTP gateway
"""
LOOPBACK = "127.0.0.1"
GATEWAY_GRACE = 5.0  # seconds the gateway gives requests in flight when stopping
INTERNAL_GRACE = 2.0  # the same for the internal services, stopped once the gateway is gone
KILL_AFTER = 1.5  # extra seconds past a grace before SIGKILL
PR_SET_PDEATHSIG = 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return serve(build_serve_parser().parse_args(rest))
    if command in SERVICES:
        _follow_supervisor()
        # Imported on demand: a gateway pod must not need torch, which the worker imports.
        return importlib.import_module(SERVICES[command]).main(rest)
    print(f"kvmesh: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


# ----------------------------------------------------------------------------- kvmesh serve


def parse_bytes(text: str) -> int:
    """`134217728`, `128MiB`, `128M`, `1GiB`, `1.5G` -> bytes (K/M/G are binary, as for memory)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 134217728, 128MiB, 1GiB)")
    number, unit = float(match.group(1)), match.group(2)
    return int(number * 1024 ** " kmgt".index(unit or " "))


def build_serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh serve",
                                     description="Serve a model behind an OpenAI-compatible API on this machine.")
    parser.add_argument("--model", default="smollm2", help="model name, Hugging Face folder or GGUF file")
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    parser.add_argument("--host", default=LOOPBACK, help="interface the API listens on")
    parser.add_argument("--port", type=int, default=8000, help="port of the API")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--device", default="cpu", help="torch device of the worker (cpu, cuda)")
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                        help="KV cache size, e.g. 512MiB (default: a fraction of free memory)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-waiting", type=int, default=DEFAULT_MAX_NUM_WAITING,
                        help="requests the engine holds beyond --max-num-seqs; more get a 503 with Retry-After")
    parser.add_argument("--api-key", action="append", default=None,
                        help="a key clients must send as `Authorization: Bearer <key>` (repeatable; default: "
                             "KVMESH_API_KEY's comma-separated keys; none: no authentication)")
    Limits.add_flags(parser, lambda name, default: default)
    parser.add_argument("--cache-dir", default=None, help="where converted GGUF models are kept")
    parser.add_argument("--startup-timeout", type=float, default=600.0,
                        help="seconds each service may take to become healthy")
    parser.add_argument("--print-addresses", action="store_true",
                        help="print one JSON line with every service's address and pid once ready")
    return parser


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    address: str


SUPERVISOR_PID_ENV = "KVMESH_SUPERVISOR_PID"  # set by `kvmesh serve` for its children


def _follow_supervisor() -> None:
    """In a child of `kvmesh serve`: SIGTERM when the supervisor dies. Set here, after exec (see
    the module docstring); a supervisor already gone by now means exit at once."""
    supervisor = os.environ.pop(SUPERVISOR_PID_ENV, None)
    if supervisor is None:
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(supervisor):
        sys.exit("kvmesh: the kvmesh serve that started this service is gone")


class Supervisor:
    """The children of one `kvmesh serve`, started in order and stopped in reverse."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self.stop_requested = False

    def request_stop(self, signum: int, frame: object) -> None:
        self.stop_requested = True

    def start(self, name: str, service_argv: list[str], address: str, ready: Callable[[], bool],
              timeout: float) -> bool:
        """Start `kvmesh <name> ...` and wait until `ready()`; False if it died, the wait timed out or
        a stop was requested meanwhile (then the caller stops everything)."""
        # A process group of its own: a Ctrl-C at the terminal reaches only us, and we stop the
        # children in order.
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", name, *service_argv],
                                start_new_session=True, env={**os.environ, SUPERVISOR_PID_ENV: str(os.getpid())})
        self.children.append(Child(name, proc, address))
        deadline = time.monotonic() + timeout
        while not self.stop_requested:
            if proc.poll() is not None:
                print(f"kvmesh: the {name} exited with code {proc.returncode} while starting", file=sys.stderr)
                return False
            if ready():
                return True
            if time.monotonic() > deadline:
                print(f"kvmesh: the {name} was not healthy after {timeout:.0f}s", file=sys.stderr)
                return False
            time.sleep(0.2)
        return False

    def wait(self) -> Child | None:
        """Until a stop is requested (None) or a child exits (that child)."""
        while not self.stop_requested:
            for child in self.children:
                if child.proc.poll() is not None:
                    return child
            time.sleep(0.2)
        return None

    def stop(self) -> None:
        """The gateway first (it lets requests in flight finish), then the others together."""
        front = [c for c in self.children if c.name == "gateway"]
        back = [c for c in reversed(self.children) if c.name != "gateway"]
        self._stop(front, GATEWAY_GRACE + KILL_AFTER)
        self._stop(back, INTERNAL_GRACE + KILL_AFTER)

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
            # The whole group: the service and anything it started.
            try:
                os.killpg(child.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.proc.wait()


def serve(args: argparse.Namespace) -> int:
    supervisor = Supervisor()
    previous = {sig: signal.signal(sig, supervisor.request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _serve(args, supervisor)
    finally:
        supervisor.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve(args: argparse.Namespace, supervisor: Supervisor) -> int:
    worker_port, engine_port, processor_port, *metrics_ports = free_ports(6)
    worker, engine, processor = (f"{LOOPBACK}:{p}" for p in (worker_port, engine_port, processor_port))
    served_model_name = args.served_model_name or args.model
    model_flags = ["--model", args.model] + (["--cache-dir", args.cache_dir] if args.cache_dir else [])
    worker_argv = [*model_flags, "--host", LOOPBACK, "--port", str(worker_port), "--dtype", args.dtype,
                   "--device", args.device, "--attention-backend", args.attention_backend,
                   "--max-num-seqs", str(args.max_num_seqs), "--grace", str(INTERNAL_GRACE)]
    if args.kv_cache_memory is not None:
        worker_argv += ["--kv-cache-memory", str(args.kv_cache_memory)]
    if args.max_model_len is not None:
        worker_argv += ["--max-model-len", str(args.max_model_len)]
    engine_argv = ["--worker-address", worker, "--host", LOOPBACK, "--port", str(engine_port),
                   "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
                   str(args.max_num_batched_tokens), "--max-num-waiting", str(args.max_num_waiting),
                   "--grace", str(INTERNAL_GRACE)]
    processor_argv = [*model_flags, "--engine-address", engine, "--host", LOOPBACK, "--port",
                      str(processor_port), "--grace", str(INTERNAL_GRACE)]
    gateway_argv = ["--processor-address", processor, "--served-model-name", served_model_name,
                    "--host", args.host, "--port", str(args.port), "--grace", str(GATEWAY_GRACE),
                    *Limits.from_args(args).to_argv()]
    for key in args.api_key or []:  # else the gateway reads KVMESH_API_KEY, which it inherits
        gateway_argv += ["--api-key", key]
    api = f"http://{_url_host(args.host)}:{args.port}"
    # Each internal service's /metrics on a free loopback port; the gateway's /metrics merges them.
    metrics = {"worker": f"http://{LOOPBACK}:{metrics_ports[0]}/metrics", "gateway": f"{api}/metrics",
               "engine": f"http://{LOOPBACK}:{metrics_ports[1]}/metrics",
               "processor": f"http://{LOOPBACK}:{metrics_ports[2]}/metrics"}
    for service_argv, port in zip((worker_argv, engine_argv, processor_argv), metrics_ports):
        service_argv += ["--metrics-port", str(port), "--served-model-name", served_model_name]
    gateway_argv += ["--aggregate-metrics", ",".join(metrics[name] for name in ("worker", "engine", "processor"))]
    steps = [
        ("worker", worker_argv, worker, lambda: grpc_serving(worker)),
        ("engine", engine_argv, engine, lambda: grpc_serving(engine)),
        ("processor", processor_argv, processor, lambda: grpc_serving(processor)),
        ("gateway", gateway_argv, f"{args.host}:{args.port}", lambda: http_ok(f"{api}/health")),
    ]
    for name, service_argv, address, ready in steps:
        if not supervisor.start(name, service_argv, address, ready, args.startup_timeout):
            return 0 if supervisor.stop_requested else 1
    print(f"kvmesh: serving {served_model_name} at {api}/v1 (Ctrl-C to stop)", flush=True)
    if args.print_addresses:
        services = {c.name: {"address": c.address, "pid": c.proc.pid, "metrics": metrics[c.name]}
                    for c in supervisor.children}
        print(json.dumps({"kvmesh": "ready", "api": f"{api}/v1", "services": services}), flush=True)
    died = supervisor.wait()
    if died is not None:
        print(f"kvmesh: the {died.name} exited with code {died.proc.returncode}; stopping the others", file=sys.stderr)
        return 1
    return 0


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


def grpc_serving(address: str, timeout: float = 1.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _url_host(host: str) -> str:
    """Where this machine reaches a server listening on `host`."""
    if host in ("", "0.0.0.0"):
        return LOOPBACK
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


if __name__ == "__main__":
    sys.exit(main())
