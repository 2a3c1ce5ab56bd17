"""Disaggregated prefill/decode in the engine: the decode side's remote prefill and the
prefill side's prefill-into-a-transfer, over an AsyncEngine and its worker group.

Decode engine D, for a request the processor's decider gave a prefill engine P:

    engine loop: allocate blocks for the prompt's full blocks beyond D's cached prefix (no hash yet)
    P.Prefill(task) ──────────────▶ P: hold the request's blocks on free (a lease), compute the prompt
                                       (max_tokens 1), sample the first token
    ◀── first token ─────────────── P: its workers send the blocks to D's (SendKV, per rank)
    D's workers ReceiveKV ◀════ KV blocks over the (P worker, D worker) pair's process group ════
    ◀── sent ───────────────────── P
    engine loop: cache the blocks under the prompt's hashes and free them; the request joins the
    waiting queue with the first token as its first output; its admission hits the blocks and
    computes only the prompt's last partial block and that token
    P.ReleaseTransfer ────────────▶ P frees the lease (or it expires: a vanished D never strands it)

Any failure or timeout on the way (P unreachable or killed, the transfer broken) and D frees the
blocks uncached and computes the prompt itself: the same tokens, later (`recomputes`). D waits at
most `Timeouts.prefill` for P's first token and `Timeouts.transfer` for the blocks after it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import NamedTuple

from services.common.clients import EngineInfo
from services.common.engine_output import EngineCoreOutput, EngineCoreRequest, PrefillProgress, PrefillTask
from services.common.errors import EngineDeadError, InternalError
from services.engine.async_engine import AsyncEngine
from services.engine.client import GrpcEngineClient
from services.engine.executor import GroupWorkerClient
from services.engine.kv_cache_manager import KVCacheManager, TransferBlocks
from services.engine.metrics import DisaggregationMetrics
from services.engine.request import Request

logger = logging.getLogger(__name__)

# What a remote prefill may fail with: D recomputes on any of them.
TRANSFER_ERRORS = (ConnectionError, TimeoutError, EngineDeadError, InternalError, ValueError, StopAsyncIteration)


class TransferRefused(ValueError):
    """P cannot send to D: no KV-transfer endpoints, unequal tensor-parallel sizes or block sizes."""


class Timeouts(NamedTuple):
    """Seconds: P's lease on blocks it sent; D's wait for P's first token; a transfer after it."""

    lease: float
    prefill: float
    transfer: float


class Planned(NamedTuple):
    request: Request
    blocks: TransferBlocks


class Disaggregation:
    def __init__(self, engine: AsyncEngine, worker: GroupWorkerClient, connect: Callable[[str], GrpcEngineClient],
                 role: str, timeouts: Timeouts, metrics: DisaggregationMetrics | None = None) -> None:
        self.engine = engine
        self.worker = worker
        self.role = role
        self.lease_seconds = timeouts.lease
        self.transfer_timeout = timeouts.transfer
        self.prefill_timeout = timeouts.prefill
        self.metrics = metrics
        self._connect = connect
        self._clients: dict[str, GrpcEngineClient] = {}  # prefill engines by address
        self._peer_infos: dict[str, EngineInfo] = {}  # their info (workers' endpoints), asked once
        self._tasks: dict[str, asyncio.Task[None]] = {}  # remote prefills in flight, by request id
        self._background: set[asyncio.Task[None]] = set()  # releases
        self.num_recomputes = 0

    @property
    def manager(self) -> KVCacheManager:
        return self.engine.core.kv_cache_manager

    # ------------------------------------------------------------------ decode side

    def start(self, request: EngineCoreRequest) -> None:
        """Prefill `request` on its prefill engine, then admit it here (event loop)."""
        if self.role == "prefill" or request.sampling_params.structured_outputs is not None:
            # A prefill engine decodes nothing it was not asked to prefill; a constrained request's
            # first token must be masked by its grammar, which is compiled here.
            self.engine.admit(replace(request, prefill_engine_address=None))
            return
        self._tasks[request.request_id] = asyncio.create_task(self._prefill_remotely(request))

    def cancel(self, request_id: str) -> None:
        """The request's stream closed: stop its remote prefill, free its blocks (idempotent)."""
        task = self._tasks.pop(request_id, None)
        if task is not None and not task.done():
            task.cancel()

    async def _prefill_remotely(self, request: EngineCoreRequest) -> None:
        request_id, address = request.request_id, request.prefill_engine_address
        local = replace(request, prefill_engine_address=None)
        try:
            planned = await self.engine.call_in_loop(lambda: self._plan(request))
            if planned is None:
                if self.metrics is not None:
                    self.metrics.local_prefills.inc()
                self.engine.admit(local)
                return
            try:
                first = await self._transfer(address, local, planned.blocks)
            except TRANSFER_ERRORS as exc:
                reason = failure_reason(exc)
                logger.warning("remote prefill of %s on %s failed (%s: %s); computing it here", request_id, address,
                               reason, exc)
                await self.engine.call_in_loop(lambda: self.manager.cancel_transfer(request_id))
                self._peer_infos.pop(address, None)  # it may have restarted: other endpoints
                self.num_recomputes += 1
                if self.metrics is not None:
                    self.metrics.failures[reason].inc()
                    self.metrics.recomputes.inc()
                self._release(address, request_id)
                self.engine.admit(local)
                return
            output = await self.engine.call_in_loop(lambda: self._commit(request, planned, first))
            self._release(address, request_id)
            self.engine.deliver(request_id, output)
        except asyncio.CancelledError:
            self.engine.call_soon_in_loop(lambda: self.manager.cancel_transfer(request_id))
            if address is not None:
                self._release(address, request_id)
            raise
        except Exception as exc:  # refused here (its own data, a full queue): its stream ends with it
            self.engine.call_soon_in_loop(lambda: self.manager.cancel_transfer(request_id))
            self.engine.deliver(request_id, exc)
        finally:
            if self._tasks.get(request_id) is asyncio.current_task():
                del self._tasks[request_id]

    def _plan(self, request: EngineCoreRequest) -> Planned | None:
        """Engine loop: the request checked, and its transfer's blocks (None: compute it here)."""
        core_request = self.engine.core.make_request(request)
        blocks = self.manager.allocate_transfer(core_request)
        return None if blocks is None else Planned(core_request, blocks)

    async def _transfer(self, address: str, request: EngineCoreRequest, blocks: TransferBlocks) -> PrefillProgress:
        """P computes the prompt and sends its blocks into ours; P's first token."""
        client = self._client(address)
        peers = await self._peers(address, client)
        task = PrefillTask(request, self.worker.kv_transfer_endpoints, blocks.first_block, blocks.block_ids,
                           secrets.randbits(31))
        stream = client.prefill(task, timeout=self.prefill_timeout + self.transfer_timeout)
        async with aclosing(stream):
            try:
                first = await asyncio.wait_for(anext(stream), self.prefill_timeout)
            except TRANSFER_ERRORS as exc:
                raise PrefillFailed(str(exc) or type(exc).__name__) from exc
            if first.first_token_id is None:
                raise PrefillFailed("the prefill engine sent no token")
            start = time.perf_counter()
            num_bytes = await asyncio.wait_for(
                asyncio.to_thread(self.worker.receive_kv, peers, blocks.block_ids, task.tag),
                self.transfer_timeout + 1.0)  # the workers' own timeout ends it first
            async for _ in stream:  # P's `sent`: its side is done too
                pass
        if self.metrics is not None:
            self.metrics.record_transfer("received", num_bytes, time.perf_counter() - start)
        return first

    def _commit(self, request: EngineCoreRequest, planned: Planned, first: PrefillProgress) -> EngineCoreOutput:
        """Engine loop: the blocks into the prefix cache, the request in with its first token."""
        self.manager.commit_transfer(planned.request, planned.blocks)
        output = self.engine.core.scheduler.add_prefilled_request(planned.request, first.first_token_id)
        output.new_logprobs = first.first_logprobs
        if self.engine.metrics is not None:  # the engine's own (vLLM's names), on this thread as always
            self.engine.metrics.add_prefilled_request(request, output)
        return output

    async def _peers(self, address: str, client: GrpcEngineClient) -> tuple[str, ...]:
        info = self._peer_infos.get(address)
        if info is None:
            try:
                info = await client.info()
            except TRANSFER_ERRORS as exc:
                raise PrefillFailed(f"the prefill engine {address} did not answer: {exc}") from exc
        own = self.worker.kv_transfer_endpoints
        if not info.kv_transfer_endpoints or not own:
            raise TransferRefused(f"the prefill engine {address} or this engine has workers without a KV-transfer "
                                  "endpoint (--kv-transfer-address)")
        if len(info.kv_transfer_endpoints) != len(own) or info.block_size != self.engine.core.block_size:
            raise TransferRefused(f"the prefill engine {address} has {len(info.kv_transfer_endpoints)} ranks and "
                                  f"block size {info.block_size}; this one {len(own)} and "
                                  f"{self.engine.core.block_size}: they must be equal")
        self._peer_infos[address] = info
        return info.kv_transfer_endpoints

    def _client(self, address: str) -> GrpcEngineClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = self._connect(address)
        return client

    def _release(self, address: str, request_id: str) -> None:
        """Tell P to free its lease, in the background (if it cannot be told, the lease expires)."""
        async def release() -> None:
            try:
                await self._client(address).release_transfer(request_id)
            except (ConnectionError, TimeoutError, EngineDeadError, InternalError) as exc:
                logger.info("could not release %s's lease on %s (it will expire): %s", request_id, address, exc)
        task = asyncio.create_task(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ prefill side

    async def prefill(self, task: PrefillTask) -> AsyncIterator[PrefillProgress]:
        """Compute `task`'s prompt and sample its first token (yielded), then send its blocks to the
        decode engine's workers (then `sent`). Its blocks stay held under a lease until
        release() or expiry."""
        if self.role == "decode":
            raise ValueError("this engine's role is decode: it prefills for no other engine")
        if task.request.sampling_params.structured_outputs is not None:
            raise ValueError("a request with structured outputs is prefilled where it decodes (its grammar "
                             "masks the first token), not sent to a prefill engine")
        params = task.request.sampling_params
        request = replace(task.request, prefill_engine_address=None,
                          sampling_params=replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1)))
        request_id = request.request_id
        await self.engine.call_in_loop(lambda: self.manager.hold_on_free(request_id, self.lease_seconds))
        first: EngineCoreOutput | None = None
        try:
            async with aclosing(self.engine.generate(request)) as stream:
                async for output in stream:
                    if output.new_token_ids:
                        first = output
        finally:
            if first is None:  # refused, aborted or failed: nothing will be sent
                self.engine.call_soon_in_loop(lambda: self.manager.release_lease(request_id))
        if first is None:
            raise ConnectionError(f"request {request_id} ended before its first token")
        yield PrefillProgress(first.new_token_ids[0], first.new_logprobs, first.num_cached_tokens)
        held = await self.engine.call_in_loop(lambda: self.manager.leased_block_ids(request_id))
        block_ids = held[task.first_block:task.first_block + len(task.block_ids)]
        if len(block_ids) != len(task.block_ids):
            raise ValueError(f"request {request_id}: asked for blocks {task.first_block}.."
                             f"{task.first_block + len(task.block_ids) - 1}, this engine holds {len(held)}")
        start = time.perf_counter()
        num_bytes = await asyncio.to_thread(self.worker.send_kv, task.receiver_endpoints, block_ids, task.tag)
        if self.metrics is not None:
            self.metrics.record_transfer("sent", num_bytes, time.perf_counter() - start)
        yield PrefillProgress(sent=True, bytes_sent=num_bytes)

    async def release(self, request_id: str) -> None:
        await self.engine.call_in_loop(lambda: self.manager.release_lease(request_id))

    def record_expired(self, count: int) -> None:
        """Engine loop: leases freed by expiry (a counter's inc is thread-safe)."""
        if self.metrics is not None:
            self.metrics.leases_expired.inc(count)

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), *self._background, return_exceptions=True)
        await asyncio.gather(*(client.close() for client in self._clients.values()))


class PrefillFailed(ConnectionError):
    """The prefill engine failed or timed out before its first token."""


def failure_reason(exc: BaseException) -> str:
    """The `reason` label of kvmesh_kv_transfer_failures for a failed remote prefill."""
    if isinstance(exc, TransferRefused):
        return "incompatible"
    timeout = isinstance(exc, TimeoutError) or isinstance(exc.__cause__, TimeoutError)
    if isinstance(exc, PrefillFailed):
        return "prefill_timeout" if timeout else "prefill_error"
    return "transfer_timeout" if timeout else "transfer_error"
