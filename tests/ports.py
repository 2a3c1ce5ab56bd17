"""Loopback ports for the services a test starts.

A port is chosen first and bound later, by the service. If the kernel could hand the same port to
anyone meanwhile (a bind to port 0, an outgoing connection), a service would now and then fail to
start with "address already in use". So the tests take their ports from below the kernel's
ephemeral range, which it never hands out, and each pytest-xdist worker takes them from a slice of
its own, in turn, never the same one twice while a slice lasts.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
from pathlib import Path

LOWEST = 10_000  # above the ports well-known services listen on
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_start() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def worker_slice() -> range:
    """This pytest process's ports: its share of [LOWEST, the ephemeral range)."""
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), index + 1)
    size = (ephemeral_start() - LOWEST) // count
    return range(LOWEST + index * size, LOWEST + (index + 1) * size)


SLICE = worker_slice()
# From a random start, so that two suites running at once on one machine seldom meet.
_start = random.randrange(len(SLICE))
_next = itertools.cycle([*SLICE[_start:], *SLICE[:_start]])


def free_port() -> int:
    """The next port of this worker's slice that is free on 127.0.0.1 now."""
    for port in itertools.islice(_next, len(SLICE)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # someone else's service, or one of ours in TIME_WAIT
            return port
    raise RuntimeError(f"no free loopback port in {SLICE}")
