"""`kvmesh serve` started for a benchmark (services/common/processes.py starts it and reads its
`--print-addresses` line)."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from services.common import processes
from services.common.processes import stop_serve

__all__ = ["start_serve", "stop_serve"]


def start_serve(flags: Sequence[str], timeout: float = 600.0,
                env: Mapping[str, str] | None = None) -> tuple[subprocess.Popen, dict[str, Any], Path]:
    """Start `python -m services.cli serve --print-addresses *flags` (with `env` over this process's
    environment); return the process, its ready line ({"api": ..., "services": {name: {"address",
    "pid", "metrics"}}}) and the log its services write (stderr)."""
    started = processes.start_serve(flags, timeout, env)
    return started.proc, started.ready._asdict(), started.stderr
