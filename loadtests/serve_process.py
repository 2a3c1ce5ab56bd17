"""`kvmesh serve` started for a benchmark: its output to a file (never a pipe: its children inherit
it, and a pipe nobody reads stops them at their next log line once 64 KiB are waiting), its
`--print-addresses` line read from there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def start_serve(flags: Sequence[str], timeout: float = 600.0,
                env: Mapping[str, str] | None = None) -> tuple[subprocess.Popen, dict[str, Any], Path]:
    """Start `python -m services.cli serve --print-addresses *flags` (with `env` over this process's
    environment); return the process, its ready line ({"api": ..., "services": {name: {"address",
    "pid", "metrics"}}}) and its log file."""
    log = Path(tempfile.mkstemp(prefix="kvmesh-serve-", suffix=".log")[1])
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--print-addresses", *flags],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith('{"kvmesh"'):
                return proc, json.loads(line), log
        time.sleep(0.5)
    stop_serve(proc)
    raise RuntimeError(f"kvmesh serve did not come up (exit {proc.poll()}); its log: {log}")


def stop_serve(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM (serve stops its children in order), SIGKILL of the group if it does not end."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
