"""Start a service as a real subprocess on a free loopback port, wait until it is healthy, and
never leave it behind.

    with running_service(["python", "-m", "services.worker.server", "--port", str(port)], port) as worker:
        ...                       # worker.address == "127.0.0.1:<port>"
    # the whole process group is SIGKILLed on the way out, whatever happened

`health="grpc"` polls the standard grpc.health.v1 Check until SERVING; `health="http"` polls an
HTTP GET (default `/health`) until 200. A process that exits while starting fails at once with
the tail of its log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def free_port() -> int:
    """A port the kernel just handed out on 127.0.0.1 (free now; a race only in theory)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def grpc_health_status(address: str, timeout: float = 1.0, service: str = "") -> int | None:
    """The grpc.health.v1 status of `service`, or None when the server cannot be reached."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return None
    return reply.status


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


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
                healthy = grpc_health_status(service.address) == health_pb2.HealthCheckResponse.SERVING
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
