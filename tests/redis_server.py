"""A real redis-server for tests: on a free loopback port, in a temporary folder, no persistence;
stopped (and restartable on the same port, for outage tests) by its own pid. `config` adds
directives as redis-server's own flags (`--requirepass`, `--user`, `--tls-port` ...)."""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tests.ports import free_port


class RedisServer:
    def __init__(self, port: int | None = None, config: Sequence[str] = ()) -> None:
        self.port = port or free_port()
        self.config = list(config)
        self._workdir = tempfile.TemporaryDirectory(prefix="kvmesh-redis-")
        self.dir = Path(self._workdir.name)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start it (again, on the same port after a stop) and wait until it answers PING."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        with open(self.dir / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(self.dir), *self.config],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # up, with a password or without
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"redis-server on port {self.port} did not start (exit {self.proc.poll()}):\n"
                                   f"{self.log()[-2000:]}")
            time.sleep(0.05)

    def log(self) -> str:
        return (self.dir / "redis.log").read_text(errors="replace")

    def stop(self) -> None:
        """Kill it (our own redis-server, by its pid); its data is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        self.stop()
        self._workdir.cleanup()
