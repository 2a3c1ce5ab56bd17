"""KV-block transfer between workers of different engines (disaggregated prefill/decode).

Each worker that takes part hosts one TCPStore on its `kv_transfer_address` (bound to that
interface only, never to every interface) and is known to its peers by an endpoint id,
`host:port/<random>`: the random part changes with every start, so a restarted worker is a new
peer and never inherits the group of the one before it.

A transfer moves some KV blocks of every layer from the prefill worker P (the sender) to the decode
worker D (the receiver), over a two-rank torch.distributed process group per (P, D) pair:

    D: receive(peer=P's id, tag)                     P: send(peer=D's id, tag)
       the pair's group exists? no: gen = next          connect to D's store (client)
       store[ready/<tag>] = gen  ────────────────────▶  wait for ready/<tag>, read gen
       (new group: rendezvous as rank 0 under           its group for D has that gen? else (re)create
        pair/<P's id>/<gen>)  ◀──── rendezvous ─────▶   it as rank 1 under pair/<P's id>/<gen>
       recv([L, 2, n, B, H, D], tag) ◀── one send ───  stack the blocks of every layer, send(tag)
       scatter into the blocks                          done

The receiver decides the generation, so both ends always agree on which group a transfer uses.
Groups are made on demand and reused across transfers; a transfer that fails or times out drops
the pair's group on the side that saw it (the next transfer builds a new generation). Each call
waits at most `timeout` seconds (torch's default is 30 minutes). Tags keep concurrent transfers
over one pair apart. NCCL on CUDA, gloo on CPU: the same code, only the group's class differs.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from services.worker.parallel_group import namespaced

RECEIVER_RANK, SENDER_RANK = 0, 1
READY_POLL_S = 0.002  # how often a sender checks that its receiver is ready (a store round trip)


class KVTransferError(ConnectionError):
    """A transfer failed or timed out (the peer went away, hung, or never came). The caller
    recomputes; the pair's group is dropped on this side."""


class PairGroup(NamedTuple):
    gen: int
    group: dist.ProcessGroup


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.partition("/")[0].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"a KV transfer address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def new_pair_group(store: dist.Store, rank: int, host: str, device: torch.device,
                   timeout: timedelta) -> dist.ProcessGroup:
    """A two-rank group on `store`: NCCL on CUDA, gloo (over `host`'s interface only) on CPU."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def gather_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
    """[num_layers, 2, n, block_size, num_kv_heads, head_size]: blocks `block_ids` of every layer."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    return torch.stack([kv.index_select(1, index) for kv in kv_caches])


def scatter_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], blocks: torch.Tensor) -> None:
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    for layer, kv in enumerate(kv_caches):
        kv.index_copy_(1, index, blocks[layer])


class KVTransferEndpoint:
    def __init__(self, address: str, device: torch.device, timeout: float, secret: str | None = None) -> None:
        """Listen on `address` (host:port; port 0: any free one). `timeout`: seconds any one
        rendezvous, send or receive may wait. `secret`: the internal token; with it every key lives
        under a prefix only its holders can compute, so a store client without it can neither
        announce a transfer nor join a pair's group (parallel_group.namespaced)."""
        host, port = split_address(address)
        self.host = host
        self.device = device
        self.timeout = timedelta(seconds=timeout)
        # torch's TCPStore would listen on every interface; on a socket of our own it listens
        # where it is told to. The store owns the fd.
        server = socket.create_server((host, port))
        port = server.getsockname()[1]
        self._secret = secret
        self.store = namespaced(dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                              timeout=self.timeout, master_listen_fd=server.detach()),
                                secret, "kv-transfer")
        self.endpoint_id = f"{host}:{port}/{secrets.token_hex(6)}"
        self._lock = threading.Lock()  # guards the dicts and the generation counter
        self._receiving: dict[str, PairGroup] = {}  # by the sender's endpoint id
        self._sending: dict[str, PairGroup] = {}  # by the receiver's endpoint id
        self._peer_stores: dict[str, dist.Store] = {}
        self._next_gen = 0
        # One rendezvous at a time per pair and direction: a second transfer waits for the group.
        self._pair_locks: dict[tuple[str, str], threading.Lock] = {}

    @property
    def num_groups(self) -> int:
        return len(self._receiving) + len(self._sending)

    def _pair_lock(self, direction: str, peer: str) -> threading.Lock:
        with self._lock:
            return self._pair_locks.setdefault((direction, peer), threading.Lock())

    # ------------------------------------------------------------------ receiver (decode side)

    def receive(self, peer: str, tag: int, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> int:
        """Receive blocks `block_ids` (in that order) from `peer`'s send with the same tag; the bytes
        received. KVTransferError on failure or timeout (the blocks' contents are then undefined)."""
        first = kv_caches[0]
        shape = (len(kv_caches), 2, len(block_ids), *first.shape[2:])
        buffer = torch.empty(shape, dtype=first.dtype, device=first.device)
        try:
            with self._pair_lock("recv", peer):
                pair = self._receiving.get(peer)
                if pair is None:
                    self._forget_predecessors(self._receiving, peer)
                    with self._lock:
                        gen, self._next_gen = self._next_gen, self._next_gen + 1
                    self.store.set(f"ready/{tag}", str(gen))
                    group = new_pair_group(dist.PrefixStore(f"pair/{peer}/{gen}", self.store), RECEIVER_RANK,
                                           self.host, self.device, self.timeout)
                    pair = self._receiving[peer] = PairGroup(gen, group)
                else:
                    self.store.set(f"ready/{tag}", str(pair.gen))
            pair.group.recv([buffer], SENDER_RANK, tag).wait(self.timeout)
        except (RuntimeError, dist.DistError) as exc:
            self._drop(self._receiving, peer)
            raise KVTransferError(f"receiving {len(block_ids)} KV blocks from {peer} failed: {exc}") from exc
        finally:
            self.store.delete_key(f"ready/{tag}")
        scatter_blocks(kv_caches, block_ids, buffer)
        return buffer.numel() * buffer.element_size()

    # ------------------------------------------------------------------ sender (prefill side)

    def send(self, peer: str, tag: int, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> int:
        """Send blocks `block_ids` to `peer` (its receive with the same tag); the bytes sent."""
        blocks = gather_blocks(kv_caches, block_ids)
        try:
            # Wait for the receiver outside the pair's lock: it may be rendezvousing for another
            # transfer first, whose send must be able to take the lock meanwhile (or both wait out
            # the timeout: the two sides would hold the pair for different transfers).
            store = self._peer_store(peer)
            self._wait_ready(store, f"ready/{tag}")
            gen = int(store.get(f"ready/{tag}"))
            with self._pair_lock("send", peer):
                pair = self._sending.get(peer)
                if pair is None or pair.gen != gen:
                    self._forget_predecessors(self._sending, peer)
                    group = new_pair_group(dist.PrefixStore(f"pair/{self.endpoint_id}/{gen}", store), SENDER_RANK,
                                           self.host, self.device, self.timeout)
                    pair = self._sending[peer] = PairGroup(gen, group)
            pair.group.send([blocks], RECEIVER_RANK, tag).wait(self.timeout)
        except (RuntimeError, dist.DistError) as exc:
            self._drop(self._sending, peer)
            with self._lock:
                self._peer_stores.pop(peer, None)
            raise KVTransferError(f"sending {len(block_ids)} KV blocks to {peer} failed: {exc}") from exc
        return blocks.numel() * blocks.element_size()

    def _wait_ready(self, store: dist.Store, key: str) -> None:
        """Polls rather than `store.wait`: the peer's store client is shared by this worker's
        transfers to it, and a blocking wait would hold its one connection from the others."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the receiver was not ready for {key} within {self.timeout.total_seconds():g} s")
            time.sleep(READY_POLL_S)

    def _peer_store(self, peer: str) -> dist.Store:
        with self._lock:
            store = self._peer_stores.get(peer)
        if store is None:
            host, port = split_address(peer)
            store = namespaced(dist.TCPStore(host, port, is_master=False, timeout=self.timeout), self._secret,
                               "kv-transfer")
            with self._lock:
                self._peer_stores[peer] = store
        return store

    def _forget_predecessors(self, groups: dict[str, PairGroup], peer: str) -> None:
        """Drop the groups of earlier incarnations of `peer` (the same host:port, another start): a
        restarted worker never comes back to them."""
        address = peer.partition("/")[0]
        with self._lock:
            for other in [p for p in groups if p != peer and p.partition("/")[0] == address]:
                del groups[other]
                self._peer_stores.pop(other, None)

    def _drop(self, groups: dict[str, PairGroup], peer: str) -> None:
        """Tear the pair's group down: the peer failed it (a later transfer builds a new one)."""
        with self._lock:
            groups.pop(peer, None)  # the last reference: its connections close with it

    def close(self) -> None:
        with self._lock:
            self._receiving.clear()
            self._sending.clear()
            self._peer_stores.clear()
