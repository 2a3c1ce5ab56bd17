"""A worker's tensor-parallel group: its rank, its size and the few collectives the sharded model
and the model runner need.

Size 1 is no group at all: every collective is a no-op that returns its input untouched, so a
single worker runs exactly as before (no process group, no copies). Size N rendezvous through a
TCPStore that rank 0 hosts on the host of `distributed_address` (not on every interface), and
every collective waits at most `distributed_timeout` seconds: a rank whose peer died fails its
step with GroupError instead of hanging in a collective for torch's default 30 minutes.

A TCPStore has no authentication, so a group with a secret (the internal token) keeps every key
under a prefix derived from it: a client that does not know the token can connect but cannot
find, join or overwrite the group's keys. Gloo's own sockets bind the interface that holds the
rendezvous host's address (loopback under `kvmesh serve`), not the hostname's.

Collectives, all over the whole group and called by every rank in the same order:

    all_reduce       sum of the ranks' partial results (row-parallel layers, vocab embedding)
    gather_to_driver rank 0 gets every rank's slice concatenated on the last dim; others get None
    broadcast_tokens rank 0's sampled token ids to every rank (each keeps its own persistent batch)
    min_over_group   the smallest of the ranks' ints (the KV blocks they can all hold)
"""

from __future__ import annotations

from datetime import timedelta
import fcntl
import hashlib
import hmac
import ipaddress
import os
import socket
import struct

import torch
import torch.distributed as dist

from services.common.config import ParallelConfig

DRIVER_RANK = 0


class GroupError(ConnectionError):
    """A collective failed or timed out: a peer died or hung. The group cannot recover; the worker
    fails its step (UNAVAILABLE on the wire, services/common/errors.py) and exits so that its
    supervisor restarts it (services/worker/server.py)."""


def split_evenly(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` when `n` items are cut into `parts` contiguous runs whose
    sizes differ by at most one, the first `n % parts` runs being the longer ones."""
    base, extra = divmod(n, parts)
    return index * base + min(index, extra), base + (index < extra)


class TensorParallelGroup:
    def __init__(self, rank: int = 0, size: int = 1, group: dist.ProcessGroup | None = None,
                 device: torch.device = torch.device("cpu")) -> None:
        assert (size == 1) == (group is None), "a group of one has no process group; a larger one needs one"
        self.rank = rank
        self.size = size
        self.group = group
        self.device = device  # where the collectives' own small tensors live (NCCL: the GPU)

    @property
    def is_driver(self) -> bool:
        return self.rank == DRIVER_RANK

    @classmethod
    def create(cls, parallel: ParallelConfig, device: torch.device,
               secret: str | None = None) -> TensorParallelGroup:
        """Join the group `parallel` names; blocks until every rank has joined (at most the timeout).
        `secret`: the internal token every rank holds; a rank without it never meets the others."""
        size, rank = parallel.tensor_parallel_size, parallel.rank
        if size == 1:
            return cls()
        if parallel.distributed_address is None:
            raise ValueError(f"a tensor-parallel group of {size} needs distributed_address (rank 0's host:port)")
        host, _, port = parallel.distributed_address.rpartition(":")
        host = host.strip("[]")  # [::1]:29500
        timeout = timedelta(seconds=parallel.distributed_timeout)
        try:
            # torch's TCPStore would listen on every interface; on a socket of our own it listens
            # where it is told to (the pod's address; loopback in tests). The store owns the fd.
            listen_fd = socket.create_server((host, int(port))).detach() if rank == DRIVER_RANK else None
            store = dist.TCPStore(host, int(port), size, is_master=rank == DRIVER_RANK, timeout=timeout,
                                  master_listen_fd=listen_fd)
            if device.type != "cuda":
                bind_gloo_to(host)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                    store=namespaced(store, secret, "tensor-parallel"), rank=rank,
                                    world_size=size, timeout=timeout)
        except (OSError, RuntimeError, dist.DistError) as exc:
            raise GroupError(f"rank {rank} of {size} could not join its group at {parallel.distributed_address} "
                             f"within {parallel.distributed_timeout:g}s: {exc}") from exc
        return cls(rank, size, dist.group.WORLD, device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place in `x` (returned)."""
        if self.size > 1:
            self._run(dist.all_reduce, x, group=self.group)
        return x

    def gather_to_driver(self, x: torch.Tensor) -> torch.Tensor | None:
        """[..., d] from every rank (the same shape on each) -> [..., size * d] on rank 0; None elsewhere."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_driver else None
        self._run(dist.gather, x, parts, dst=DRIVER_RANK, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_tokens(self, token_ids: list[int] | None, count: int) -> list[int]:
        """Rank 0's `token_ids` (`count` of them) on every rank."""
        if self.size == 1:
            assert token_ids is not None
            return token_ids
        if self.is_driver:
            t = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        else:
            t = torch.empty(count, dtype=torch.int64, device=self.device)
        assert t.numel() == count, f"{t.numel()} tokens to broadcast, {count} expected"
        self._run(dist.broadcast, t, src=DRIVER_RANK, group=self.group)
        return t.tolist()

    def min_over_group(self, value: int) -> int:
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._run(dist.all_reduce, t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def _run(self, collective, *args, **kwargs) -> None:
        try:
            collective(*args, **kwargs)
        except (RuntimeError, dist.DistError) as exc:
            raise GroupError(f"rank {self.rank} of {self.size}: {collective.__name__} failed "
                             f"(a peer died or hung): {exc}") from exc

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


def namespaced(store: dist.Store, secret: str | None, purpose: str) -> dist.Store:
    """`store` with every key under a prefix only holders of `secret` can compute (no secret: as is)."""
    if not secret:
        return store
    tag = hmac.new(secret.encode(), f"kvmesh {purpose} store".encode(), hashlib.sha256).hexdigest()
    return dist.PrefixStore(tag, store)


_SIOCGIFADDR = 0x8915


def interface_of(host: str) -> str | None:
    """The name of the network interface that holds `host`'s IPv4 address (loopback: the loopback
    one); None when none does (an IPv6 or unresolvable host)."""
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # an interface without an IPv4 address
            if ipaddress.ip_address(raw[20:24]) == address or (address.is_loopback and name == "lo"):
                return name
    return None


def bind_gloo_to(host: str) -> None:
    """Have gloo listen on the interface of `host` rather than on the hostname's address, which is
    often the LAN's. An operator's own GLOO_SOCKET_IFNAME wins."""
    name = interface_of(host)
    if name is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)


def free_loopback_address() -> str:
    """127.0.0.1:<a port free now>, for a group whose ranks all run on this host (tests, one pod)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"
