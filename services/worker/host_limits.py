"""What this process may take of the host: memory (/proc/meminfo's MemAvailable) and CPU threads (its
affinity mask), each bounded by the limits of its cgroup and the cgroups above it. In a container
/proc/meminfo and the affinity mask describe the whole node, while the pod's limits are in its
cgroup: a KV cache sized from the node's free memory gets the worker OOM-killed as its blocks
fill, and an OpenMP team as wide as the node under a smaller CPU quota spends most of each period
throttled, its other threads waiting at the barrier.

Both cgroup versions: v2 (memory.max, memory.current; cpu.max) and v1 (memory.limit_in_bytes,
memory.usage_in_bytes; cpu.cfs_quota_us, cpu.cfs_period_us). A cgroup's memory room is its limit
less its usage, plus the inactive file pages in its usage (page cache the kernel reclaims before it
kills), as MemAvailable counts them."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

# v1 writes "no limit" as the largest multiple of the page size below 2**63.
_V1_NO_LIMIT = 2**62
# Where the v2 hierarchy is mounted, the first that exists; v1's controllers are under /sys/fs/cgroup.
_V2_MOUNTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
_V1_ROOT = Path("/sys/fs/cgroup")


def available_bytes() -> int:
    """MemAvailable, or the room left under the tightest cgroup memory limit, whichever is less."""
    available = _mem_available()
    room = _tightest("memory", "memory.max", "memory.limit_in_bytes", _memory_room)
    return available if room is None else min(available, int(room))


def cpu_threads() -> int:
    """The CPUs this process may run on, or the whole CPUs' worth of time its tightest CPU quota
    allows, whichever is less (at least one)."""
    cpus = len(os.sched_getaffinity(0))
    quota = _tightest("cpu", "cpu.max", "cpu.cfs_quota_us", _cpu_quota)
    return cpus if quota is None else max(1, min(cpus, math.floor(quota)))


def _mem_available() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def _tightest(controller: str, v2_file: str, v1_file: str, limit_of: Callable[[Path, bool], float | None]
              ) -> float | None:
    """The least of `limit_of(directory, is_v2)` over this process's cgroups of `controller`; None
    without limits, or where the files cannot be read (a cgroup that went away, another format)."""
    try:
        limits = [limit for directory, v2 in cgroups(controller, v2_file, v1_file)
                  if (limit := limit_of(directory, v2)) is not None]
    except (OSError, ValueError):
        return None
    return min(limits, default=None)


def cgroups(controller: str, v2_file: str, v1_file: str) -> list[tuple[Path, bool]]:
    """This process's cgroup directories for `controller` that hold its limit file, its own first,
    up to the hierarchy's root, each with whether it is v2."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy, "0::/path"
            mount = next((Path(m) for m in _V2_MOUNTS if (Path(m) / "cgroup.controllers").exists()), None)
            limit_file, v2 = v2_file, True
        elif controller in controllers.split(","):
            mount, limit_file, v2 = _V1_ROOT / controller, v1_file, False
        else:
            continue
        if mount is None or not mount.is_dir():
            continue
        # Without a cgroup namespace the path is the host's, and a container sees its own cgroup at
        # the mount's root: fall back to the root where the path is not there.
        own = mount / path.lstrip("/")
        directory = own if own.is_dir() else mount
        chain = [directory, *[p for p in directory.parents if p.is_relative_to(mount)]]
        found = [(d, v2) for d in chain if (d / limit_file).exists()]
        if found:
            return found
    return []


def _memory_room(directory: Path, v2: bool) -> float | None:
    limit = (directory / ("memory.max" if v2 else "memory.limit_in_bytes")).read_text().strip()
    if limit == "max" or int(limit) >= _V1_NO_LIMIT:
        return None
    usage = int((directory / ("memory.current" if v2 else "memory.usage_in_bytes")).read_text())
    stat = dict(line.split(" ", 1) for line in (directory / "memory.stat").read_text().splitlines())
    inactive = int(stat.get("inactive_file" if v2 else "total_inactive_file", 0))
    return max(0, int(limit) - usage + inactive)


def _cpu_quota(directory: Path, v2: bool) -> float | None:
    """CPUs' worth of time per period: cpu.max "<quota> <period>" ("max": none), or v1's pair (-1: none)."""
    if v2:
        quota, period = (directory / "cpu.max").read_text().split()
    else:
        quota = (directory / "cpu.cfs_quota_us").read_text().strip()
        period = (directory / "cpu.cfs_period_us").read_text().strip()
    if quota in ("max", "-1"):
        return None
    return int(quota) / int(period)
