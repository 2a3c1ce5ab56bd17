"""The engine's executor over a tensor-parallel group: one WorkerClient over N workers (ranks).

Every rank runs the same worker service; the engine sends each call to every rank at once, with
the same message, and the ranks' collectives do the rest (services/worker/). Only rank 0 (the
driver) returns sampled tokens; the others return an empty ModelRunnerOutput.

    engine-loop thread: execute_model ─┬─ rank 0 (pool thread)   its step      ──► the step's output
                                       ├─ rank 1 (pool thread)   its step      ──► empty
                                       └─ rank N-1 (pool thread) ...          ──► empty
                                       wait for all, or for the first failure: it fails the step

Send-to-all rather than send-to-rank-0-which-broadcasts: the step message travels N times over
the network instead of once, but no rank waits for another to relay it, and the engine sees each
rank's failure directly (docs/benchmarks/log.md, "Tensor parallel: the step's fan-out").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import TypeVar

from services.common.clients import WorkerClient, WorkerInfo
from services.common.model_runner_output import ModelRunnerOutput
from services.common.scheduler_output import SchedulerOutput

T = TypeVar("T")
TRANSFER_THREADS_PER_RANK = 4


class GroupWorkerClient:
    """A WorkerClient over `ranks` (rank order: ranks[0] drives). With several ranks each call runs
    on a persistent pool of one thread per rank (a thread per step would cost its start-up every
    step); a group of one calls its client directly, at no cost over it. A call returns once every
    rank answered, and fails as soon as one rank fails, with the first failure in rank order among
    those failed by then: a dead rank fails the step at once, not when its peers' collectives time
    out (they stay in flight until their own call ends; close() cancels them)."""

    def __init__(self, ranks: Sequence[WorkerClient]) -> None:
        if not ranks:
            raise ValueError("a worker group needs at least one worker")
        self.ranks = tuple(ranks)
        self._pool = ThreadPoolExecutor(len(ranks), "worker-rank") if len(ranks) > 1 else None
        # KV transfers: several in flight at once, each a call per rank.
        self._transfer_pool = ThreadPoolExecutor(TRANSFER_THREADS_PER_RANK * len(ranks), "kv-transfer")
        self._kv_endpoints: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def _on_all(self, call: Callable[[WorkerClient], T]) -> list[T]:
        """`call` on every rank at once; the results in rank order, or the first failure."""
        if self._pool is None:
            return [call(self.ranks[0])]
        futures = [self._pool.submit(call, rank) for rank in self.ranks]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            if future in done and future.exception() is not None:
                raise future.exception()
        return [future.result() for future in futures]

    def get_info(self) -> WorkerInfo:
        """Rank 0's info, once every rank answered and all agree: the same model and block size,
        each rank once, a world size of N. ValueError otherwise (the group was wired wrong)."""
        infos = self._on_all(lambda rank: rank.get_info())
        check_group(infos)
        endpoints = tuple(info.kv_transfer_endpoint for info in infos)
        self._kv_endpoints = endpoints if all(endpoints) else ()
        return infos[0]

    def initialize_cache(self, max_num_reqs: int) -> int:
        """Every rank sizes and allocates its cache; they agree on the minimum among themselves (a
        collective), so each answers the same number of blocks. RuntimeError when they do not."""
        num_blocks = self._on_all(lambda rank: rank.initialize_cache(max_num_reqs))
        if len(set(num_blocks)) != 1:
            raise RuntimeError(f"the workers of the group disagree on the KV cache's size: num_blocks by rank "
                               f"{num_blocks} (they must agree on the minimum among themselves)")
        return num_blocks[0]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._on_all(lambda rank: rank.execute_model(scheduler_output))[0]

    def check_alive(self) -> None:
        self._on_all(lambda rank: rank.check_alive())

    @property
    def kv_transfer_endpoints(self) -> tuple[str, ...]:
        """The ranks' KV-transfer endpoint ids (rank order), once get_info() has run; () if any lacks one."""
        return self._kv_endpoints

    def send_kv(self, peers: Sequence[str], block_ids: Sequence[int], tag: int) -> int:
        """Rank r sends its shard of the blocks to peers[r] (equal TP sizes); total bytes sent."""
        return sum(self._on_all_transfer(lambda rank, peer: rank.send_kv(peer, block_ids, tag), peers))

    def receive_kv(self, peers: Sequence[str], block_ids: Sequence[int], tag: int) -> int:
        """Rank r receives its shard of the blocks from peers[r]; total bytes received."""
        return sum(self._on_all_transfer(lambda rank, peer: rank.receive_kv(peer, block_ids, tag), peers))

    def _on_all_transfer(self, call: Callable[[WorkerClient, str], T], peers: Sequence[str]) -> list[T]:
        """`call` on every rank with its peer, on a pool of its own: transfers wait on other engines'
        workers and must never hold up the step's threads."""
        if len(peers) != len(self.ranks):
            raise ValueError(f"{len(peers)} KV-transfer peers for a group of {len(self.ranks)} ranks: prefill and "
                             "decode engines need equal tensor-parallel sizes")
        futures = [self._transfer_pool.submit(call, rank, peer) for rank, peer in zip(self.ranks, peers)]
        wait(futures)
        for future in futures:
            if future.exception() is not None:
                raise future.exception()
        return [future.result() for future in futures]

    def close(self) -> None:
        """Every rank's client closed (each close is local, and cancels its call in flight), then the pool."""
        for rank in self.ranks:
            rank.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._transfer_pool.shutdown(wait=True)


def check_group(infos: Sequence[WorkerInfo]) -> None:
    """ValueError unless the infos (rank order) describe one group of len(infos) ranks of one model."""
    size = len(infos)
    ranks = [info.rank for info in infos]
    sizes = {info.world_size for info in infos}
    if sizes != {size}:
        raise ValueError(f"the engine was given {size} workers, but they report a tensor-parallel size of "
                         f"{sorted(sizes)}: start each with --tensor-parallel-size {size}")
    if ranks != list(range(size)):
        raise ValueError(f"the workers' ranks are {ranks} in the order given; expected 0..{size - 1}, each once "
                         f"(give the engine its workers in rank order)")
    first = infos[0]
    for rank, info in enumerate(infos[1:], start=1):
        for what in ("model_id", "model_path", "vocab_size", "max_model_len", "block_size"):
            if getattr(info, what) != getattr(first, what):
                raise ValueError(f"rank {rank} serves {what}={getattr(info, what)!r}, rank 0 "
                                 f"{getattr(first, what)!r}: a group runs one model with one configuration")
