"""How much memory this process may still take on the host: /proc/meminfo's MemAvailable, bounded by
the limits of its memory cgroup and the cgroups above it. In a container /proc/meminfo describes the
whole node; the pod's limit is in its cgroup, and a KV cache sized from the node's free memory would
get the worker OOM-killed as its blocks fill.

Both cgroup versions: v2 (memory.max, memory.current) and v1 (memory.limit_in_bytes,
memory.usage_in_bytes). A cgroup's room is its limit less its usage, plus the inactive file pages in
its usage (page cache the kernel reclaims before it kills), as MemAvailable counts them."""

from __future__ import annotations

from pathlib import Path

# v1 writes "no limit" as the largest multiple of the page size below 2**63.
_V1_NO_LIMIT = 2**62
# Where each version's hierarchy is mounted, the first that exists.
_V2_MOUNTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
_V1_MOUNT = "/sys/fs/cgroup/memory"


def available_bytes() -> int:
    """MemAvailable, or the room left under the tightest cgroup memory limit, whichever is less."""
    available = _mem_available()
    room = cgroup_room()
    return available if room is None else min(available, room)


def _mem_available() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def cgroup_room() -> int | None:
    """The least room under a memory limit of this process's cgroup or an ancestor; None without limits."""
    try:
        rooms = [room for directory in memory_cgroups() if (room := _room(directory)) is not None]
    except (OSError, ValueError):  # a cgroup that went away or a file in another format: no bound
        return None
    return min(rooms, default=None)


def memory_cgroups() -> list[Path]:
    """This process's memory cgroup directories, its own first, up to the mount's root."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy, "0::/path"
            mount = next((Path(m) for m in _V2_MOUNTS if (Path(m) / "cgroup.controllers").exists()), None)
        elif "memory" in controllers.split(","):
            mount = Path(_V1_MOUNT)
        else:
            continue
        if mount is None or not mount.is_dir():
            continue
        # Without a cgroup namespace the path is the host's, and a container sees its own cgroup at
        # the mount's root: fall back to the root where the path is not there.
        own = mount / path.lstrip("/")
        directory = own if own.is_dir() else mount
        chain = [directory, *[p for p in directory.parents if p.is_relative_to(mount)]]
        found = [d for d in chain if (d / "memory.max").exists() or (d / "memory.limit_in_bytes").exists()]
        if found:
            return found
    return []


def _room(directory: Path) -> int | None:
    v2 = (directory / "memory.max").exists()
    limit = (directory / ("memory.max" if v2 else "memory.limit_in_bytes")).read_text().strip()
    if limit == "max" or int(limit) >= _V1_NO_LIMIT:
        return None
    usage = int((directory / ("memory.current" if v2 else "memory.usage_in_bytes")).read_text())
    inactive_key = "inactive_file" if v2 else "total_inactive_file"
    stat = dict(line.split(" ", 1) for line in (directory / "memory.stat").read_text().splitlines())
    return max(0, int(limit) - usage + int(stat.get(inactive_key, 0)))
