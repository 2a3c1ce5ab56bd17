"""A local user cannot take over a restarting service of `kvmesh serve` to collect its callers'
bearer tokens. serve used to give its internal services free loopback ports, and a restart reused
them: whoever bound the port while the engine was down received the processor's token. Now the
internal services listen on Unix sockets in serve's private 0700 directory (under
$XDG_RUNTIME_DIR when usable): no internal TCP port is left to squat, and no other user may enter
the directory to bind or reach a socket there. A restarted engine binds its old path again.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest
from grpc_health.v1 import health_pb2

from services.common.unix_socket import socket_path
from tests.services.procs import (PYTHON, REPO_ROOT, Serve, client_for, gone, grpc_health_status, running_serve,
                                  serve_child_pid)

pytestmark = pytest.mark.slow

INTERNAL = ("worker", "engine", "processor")
SERVING = health_pb2.HealthCheckResponse.SERVING
RECOVERY_SECONDS = 300.0  # the pair's back-off and model load, on a loaded 2-core machine
NOBODY = 65534
LISTEN = "0A"  # the LISTEN state in /proc/net/tcp
ACCEPTING = 0x10000  # __SO_ACCEPTCON in /proc/net/unix: a listening socket

# Run as root, then as `nobody` from its first line on: another local user trying to take the
# restarting engine's socket and to reach the processor's.
SQUATTER = """
import errno, json, os, socket, sys
os.setgroups([]); os.setgid(%d); os.setuid(%d)
engine, processor = sys.argv[1], sys.argv[2]
def attempt(call):
    try:
        call()
        return "done"
    except OSError as exc:
        return errno.errorcode[exc.errno]
print(json.dumps({"bind": attempt(lambda: socket.socket(socket.AF_UNIX).bind(engine)),
                  "connect": attempt(lambda: socket.socket(socket.AF_UNIX).connect(processor)),
                  "list": attempt(lambda: os.listdir(os.path.dirname(engine)))}))
""" % (NOBODY, NOBODY)


@pytest.fixture(scope="module")
def runtime_dir() -> Iterator[Path]:
    """An $XDG_RUNTIME_DIR of this user's, as a login session has."""
    with tempfile.TemporaryDirectory(prefix="xdg-") as directory:
        os.chmod(directory, 0o700)
        yield Path(directory)


@pytest.fixture(scope="module")
def stack(served_model: str, runtime_dir: Path) -> Iterator[Serve]:
    with running_serve(served_model, extra_args=["--max-model-len", "256", "--restart-backoff", "1"],
                       env={"XDG_RUNTIME_DIR": str(runtime_dir)}) as serve:
        yield serve


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


def tcp_listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (IPv4 and IPv6)."""
    inodes, ports = socket_inodes(pid), set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and int(fields[9]) in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def unix_listening_paths(pid: int) -> set[Path]:
    inodes, paths = socket_inodes(pid), set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 8 and int(fields[3], 16) & ACCEPTING and int(fields[6]) in inodes:
            paths.add(Path(fields[7]))
    return paths


def private_directory(serve: Serve) -> Path:
    directories = {socket_path(serve.services[name]["address"]).parent for name in INTERNAL}
    assert len(directories) == 1, directories
    return directories.pop()


def test_internal_services_listen_on_sockets_in_a_private_directory(stack: Serve, runtime_dir: Path):
    for name in INTERNAL:
        assert stack.services[name]["address"].startswith("unix:/"), stack.services[name]
    directory = private_directory(stack)
    assert directory.parent == runtime_dir and directory.name.startswith("kvmesh-serve-")
    status = directory.stat()
    assert stat.S_IMODE(status.st_mode) == 0o700 and status.st_uid == os.getuid()
    assert stack.token_file.parent == directory  # the tokens the sockets' callers hold live beside them

    # Each internal service listens on its socket (the worker also on its step channel's, beside
    # it) and on TCP only for /metrics, which carries no token; the gateway on the API's port only.
    for name in INTERNAL:
        pid, path = stack.services[name]["pid"], socket_path(stack.services[name]["address"])
        assert stat.S_ISSOCK(path.lstat().st_mode)
        expected = {path, path.with_name(path.name + ".step")} if name == "worker" else {path}
        assert unix_listening_paths(pid) == expected, name
        assert tcp_listening_ports(pid) == {urlsplit(stack.services[name]["metrics"]).port}, name
    assert tcp_listening_ports(stack.services["gateway"]["pid"]) == {stack.port}
    assert sorted(p.name for p in directory.iterdir() if p.is_socket()) == \
        ["engine.sock", "processor.sock", "worker.sock", "worker.sock.step"]


def test_a_restarting_engine_cannot_be_squatted(stack: Serve):
    engine = stack.services["engine"]
    path, processor = socket_path(engine["address"]), socket_path(stack.services["processor"]["address"])
    os.kill(engine["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not gone(engine["pid"]):
        assert time.monotonic() < deadline, "the engine outlived SIGKILL"
        time.sleep(0.1)

    # The engine is down: another user tries to take its socket and to reach the processor's.
    directory = path.parent
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700 and directory.stat().st_uid == os.getuid()
    if os.geteuid() == 0:  # a real other user; without root, the mode above is what keeps one out
        result = subprocess.run([PYTHON, "-I", "-c", SQUATTER, str(path), str(processor)], capture_output=True,
                                text=True, timeout=60, cwd="/")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == {"bind": "EACCES", "connect": "EACCES", "list": "EACCES"}

    # serve brings the pair back on the same path, and the processor finds the engine there.
    while "the worker and the engine are serving again" not in stack.log():
        assert stack.proc.poll() is None, stack.log()
        assert time.monotonic() < deadline + RECOVERY_SECONDS, f"the engine did not come back:\n{stack.log()}"
        time.sleep(0.5)
    assert grpc_health_status(engine["address"]) == SERVING
    deadline = time.monotonic() + 60  # the processor's channel reconnects within its back-off (2 s)
    while True:
        try:
            client, model = client_for(stack)
            reply = client.completions.create(model=model, prompt="The capital of France is", max_tokens=3,
                                              temperature=0)
            break
        except openai.APIError:  # 503 until the processor sees the engine again
            assert time.monotonic() < deadline, stack.log()
            time.sleep(1)
    assert reply.usage.completion_tokens > 0
    assert unix_listening_paths(serve_child_pid(stack, "engine")) == {path}





def test_a_directory_too_deep_for_a_socket_is_refused_and_removed(model_path: Path, tmp_path: Path):
    """A socket's path has at most 107 bytes: serve says so before starting anything, and leaves
    no directory behind."""
    deep = tmp_path / ("x" * 90)
    deep.mkdir(mode=0o700)
    result = subprocess.run([PYTHON, "-m", "services.cli", "serve", "--model", str(model_path), "--port", "0"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "XDG_RUNTIME_DIR": str(deep)})
    assert result.returncode == 2, result.stderr[-4000:]
    assert "a Unix socket's path may have at most 107 bytes" in result.stderr
    assert list(deep.iterdir()) == []
