"""The engines a processor routes to (discovered with `--engine-service`, a static `--engine-address`
list, or the prefix index's live engines): one client per ready endpoint, and the choice of engine per
request (services/processor/router.py). An `EngineClient` itself, so the `AsyncProcessor` over it is
the same as over one static engine.

    EndpointWatcher ──update(ready set)──▶ EngineSet ──choose(request)──▶ member.client.generate(request)
                                                      └─ Router(policy, prefix index) ─┘

An endpoint that leaves the ready set stops getting new requests at once; its streams in flight
run on (an engine that turned unready to drain, e.g. on SIGTERM, finishes them), and its channel
closes when the last one ends. An endpoint that comes back before then is routable again on the
same channel.

A stream whose engine dies (EngineDeadError or ConnectionError) moves to another engine with the
tokens streamed so far (services/processor/migration.py), at most `max_migrations` times: the
caller sees one uninterrupted stream. The engine that failed it is marked unhealthy until its
next health check says otherwise. A request id under which `max_engine_deaths` engines died is
failed instead (EngineDeaths), now and when it comes again: what kills engines is not replayed on
every engine of the fleet in turn.

LoRA: a request for an adapter goes to an engine holding it (services/processor/lora_affinity.py),
from the engines' reported adapters (their stats, re-read in the background) and this processor's
own requests in flight. An adapter loaded or unloaded at run time is loaded on, or unloaded from,
every ready engine: all of them or none. An engine that joins later, or comes back from a restart,
starts with its own --lora-modules only: when its stats show a run-time adapter missing, it is
loaded there again in the background (at most every RELOAD_RETRY_S seconds per engine and adapter).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, fields

from services.common.clients import EngineClient, EngineInfo, EngineStats, LoRAState, PrefixMatch
from services.common.config import RoutingConfig
from services.common.discovery import Endpoint
from services.common.errors import EngineDeadError, InternalError, ModelNotFoundError
from services.common.engine_output import EngineCoreOutput, EngineCoreRequest
from services.prefix_index.engines_index import EnginesPrefixIndex, ask_engines
from services.prefix_index.index import PrefixIndex
from services.processor.lora_affinity import STATE_MAX_AGE
from services.processor.metrics import ModelRouterMetrics
from services.processor.migration import MIGRATABLE_ERRORS, EngineDeaths, Migration
from services.processor.router import Route, Router

logger = logging.getLogger(__name__)
RELOAD_RETRY_S = 30.0  # seconds before a failed re-load of a run-time adapter on an engine is tried again


@dataclass(slots=True)
class EngineMember:
    endpoint: Endpoint
    client: EngineClient
    ready: bool = True  # in the Service's ready set
    healthy: bool = True  # its last health check said SERVING (assumed until checked)
    in_flight: int = 0  # engine requests streaming now
    info: EngineInfo | None = None  # its model, block size and index id, once asked (kv-aware routing)
    # LoRA affinity: its last stats (its adapters) and when read (time.monotonic), and this
    # processor's requests in flight on it by adapter.
    stats: EngineStats | None = None
    stats_read_at: float = float("-inf")
    lora_in_flight: Counter[str] = field(default_factory=Counter)
    lora_routed: set[str] = field(default_factory=set)  # sent it since its last stats read began
    stats_refresh: asyncio.Task[None] | None = None
    # Run-time adapters being loaded on it again, and when a re-load last started (time.monotonic).
    lora_reloading: set[str] = field(default_factory=set)
    lora_reload_started: dict[str, float] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return self.endpoint.address

    @property
    def index_id(self) -> str:
        """Its id in the prefix index: the id the engine publishes under, else its address."""
        return self.info.engine_id if self.info is not None and self.info.engine_id else self.address


class EngineSet:
    """Implements `EngineClient` over the ready engines of one Service (or a static list). Construct
    inside the running event loop; `update` is the `EndpointWatcher`'s subscriber. With no
    `prefix_index`, kv-aware routing asks the engines themselves (EnginesPrefixIndex)."""

    def __init__(self, service: str, connect: Callable[[str], EngineClient],
                 routing: RoutingConfig = RoutingConfig(), prefix_index: PrefixIndex | None = None,
                 index_timeout_s: float = 0.5, metrics: ModelRouterMetrics | None = None) -> None:
        self.service = service
        self._connect = connect  # address -> client (carries the per-call deadlines)
        self.max_migrations = routing.max_migrations  # RoutingConfig checked it
        self.max_engine_deaths = routing.max_engine_deaths
        self.deaths = EngineDeaths()
        self.members: dict[str, EngineMember] = {}  # by address; ready ones and those still draining
        self._owners: dict[str, EngineMember] = {}  # request id -> the member streaming it
        self._closing: set[asyncio.Task[None]] = set()  # strong references until the channels close
        self.index_timeout_s = index_timeout_s
        index = prefix_index if prefix_index is not None else EnginesPrefixIndex(self._index_clients, index_timeout_s)
        self.router = Router(routing, index, index_timeout_s, metrics)
        self.metrics = metrics
        self.runtime_loras: dict[str, str] = {}  # adapters loaded at run time: name -> folder
        self._reloads: set[asyncio.Task[None]] = set()  # strong references until they finish

    def update(self, endpoints: frozenset[Endpoint]) -> None:
        """The Service's ready set changed: new endpoints get a client, gone ones drain."""
        ready = {e.address: e for e in endpoints}
        for address, endpoint in ready.items():
            member = self.members.get(address)
            if member is None:
                self.members[address] = EngineMember(endpoint, self._connect(address))
                logger.info("engine %s (%s) joined %s", address, endpoint.pod or endpoint.hostname, self.service)
            elif not member.ready:
                member.ready, member.healthy = True, True
                member.info = None  # it may have restarted meanwhile (another id, block size): ask again
                logger.info("engine %s is ready again", address)
        for address, member in list(self.members.items()):
            if address not in ready and member.ready:
                member.ready = False
                logger.info("engine %s left %s with %d request(s) in flight", address, self.service, member.in_flight)
                self._retire_if_idle(member)

    async def choose(self, request: EngineCoreRequest, exclude: frozenset[str] = frozenset()) -> EngineMember:
        """The engine for `request` among the ready ones (healthy ones first) whose address is not in
        `exclude`, by the router's policy. ConnectionError when none is left."""
        return (await self._route(request, exclude)).candidate

    async def _route(self, request: EngineCoreRequest, exclude: frozenset[str]) -> Route:
        """choose()'s route, with the cached tokens it predicts (checked against the engine's first output)."""
        ready = [m for m in self.members.values() if m.ready and m.address not in exclude]
        if not ready:
            raise ConnectionError(f"no ready engine in service {self.service}"
                                  + (f" besides {', '.join(sorted(exclude))}" if exclude else ""))
        candidates = [m for m in ready if m.healthy] or ready
        if self.router.config.routing == "kv-aware" and len(candidates) > 1:
            await self._fetch_infos(candidates)
        # One engine needs no affinity, but its stats still show a run-time adapter it lost in a restart.
        if request.lora_name is not None and (len(candidates) > 1 or request.lora_name in self.runtime_loras):
            await self._refresh_stats(candidates)
        return await self.router.route(candidates, request)

    async def _refresh_stats(self, members: Sequence[EngineMember]) -> None:
        """Each member's stats (its adapters): read now the first time, within the index timeout;
        later re-read in the background once older than STATE_MAX_AGE, the last read serving meanwhile."""
        now = time.monotonic()
        stale = [m for m in members if now - m.stats_read_at > STATE_MAX_AGE
                 and (m.stats_refresh is None or m.stats_refresh.done())]
        for member in stale:
            member.stats_refresh = asyncio.create_task(self._read_stats(member))
        unread = [m.stats_refresh for m in members if m.stats is None and m.stats_refresh is not None]
        if unread:
            await asyncio.wait(unread)

    async def _read_stats(self, member: EngineMember) -> None:
        routed = set(member.lora_routed)  # the engine's answer accounts for these
        loaded = dict(self.runtime_loras)  # and for these: a load that ends during the read is not missing
        try:
            member.stats = await asyncio.wait_for(member.client.stats(), self.index_timeout_s)
        except (ConnectionError, TimeoutError, EngineDeadError, InternalError) as e:
            logger.debug("engine %s: no stats: %s", member.address, e)
        else:
            member.lora_routed -= routed
            self._reload_missing_loras(member, loaded)
        member.stats_read_at = time.monotonic()

    def _reload_missing_loras(self, member: EngineMember, loaded: dict[str, str]) -> None:
        """Load again, in the background, the run-time adapters `loaded` (those before the stats
        read) that `member`'s stats do not list: it joined or restarted since their load."""
        served = member.stats.lora.adapters if member.stats.lora is not None else ()
        now = time.monotonic()
        for name, path in loaded.items():
            if (name in served or self.runtime_loras.get(name) != path or name in member.lora_reloading
                    or now - member.lora_reload_started.get(name, float("-inf")) < RELOAD_RETRY_S):
                continue
            member.lora_reloading.add(name)
            member.lora_reload_started[name] = now
            task = asyncio.create_task(self._reload_lora(member, name, path))
            self._reloads.add(task)
            task.add_done_callback(self._reloads.discard)

    async def _reload_lora(self, member: EngineMember, name: str, path: str) -> None:
        try:
            await member.client.load_lora_adapter(name, path)
            logger.info("engine %s: LoRA adapter %s loaded again", member.address, name)
            if self.runtime_loras.get(name) != path:  # unloaded (or replaced) meanwhile: undo it there
                await member.client.unload_lora_adapter(name)
        except (ConnectionError, TimeoutError, EngineDeadError, InternalError, ValueError, ModelNotFoundError) as e:
            logger.warning("engine %s: LoRA adapter %s not loaded again: %s", member.address, name, e)
        finally:
            member.lora_reloading.discard(name)
            member.stats_read_at = float("-inf")  # its adapters changed: read them at the next request

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """One stream for `request`, moved to another engine when its engine dies mid-stream."""
        if self.deaths.count(request.request_id) >= self.max_engine_deaths:
            raise EngineDeadError(self._poison_message(request.request_id))
        migration = Migration(request)
        failed: list[str] = []  # addresses of the engines that died under this request
        died: Exception | None = None  # the last of their errors
        next_request: EngineCoreRequest | EngineCoreOutput = request
        try:
            while isinstance(next_request, EngineCoreRequest):
                try:
                    route = await self._route(next_request, frozenset(failed))
                except ConnectionError as exc:
                    if died is None:
                        raise
                    raise died from exc  # no engine left: the caller gets the error it would have got
                member = route.candidate
                try:
                    async with aclosing(self._stream(member, next_request, route.predicted_cached_tokens)) as stream:
                        async for output in stream:
                            yield migration.forward(output)
                    return
                except MIGRATABLE_ERRORS as exc:
                    died = exc
                    member.healthy = False  # until the health loop hears SERVING again
                    failed.append(member.endpoint.address)
                    if self.deaths.record(request.request_id) >= self.max_engine_deaths:
                        logger.warning("engine %s failed request %s (%s): %s", member.endpoint.address,
                                       request.request_id, exc, self._poison_message(request.request_id))
                        raise EngineDeadError(self._poison_message(request.request_id)) from exc
                    if migration.num_migrations >= self.max_migrations:
                        raise
                    logger.warning("engine %s failed request %s after %d token(s) (%s); migrating it",
                                   member.endpoint.address, request.request_id, len(migration.token_ids), exc)
                    next_request = migration.resumed()
            yield migration.forward(next_request)  # max_tokens were all streamed: only the end was lost
        finally:
            self._owners.pop(request.request_id, None)

    def _poison_message(self, request_id: str) -> str:
        return (f"request {request_id} was in flight on {self.deaths.count(request_id)} engines that stopped; "
                "it is not sent to another")

    async def _stream(self, member: EngineMember, request: EngineCoreRequest,
                      predicted: int | None) -> AsyncIterator[EngineCoreOutput]:
        """`request`'s outputs from `member`, counted in its load and owned by it while they flow;
        `predicted` (the route's cached tokens, if it predicted) is checked against the first output."""
        member.in_flight += 1
        if request.lora_name is not None:
            member.lora_in_flight[request.lora_name] += 1
            member.lora_routed.add(request.lora_name)
        self._owners[request.request_id] = member
        try:
            async with aclosing(member.client.generate(request)) as stream:  # closing early aborts it there
                async for output in stream:
                    if predicted is not None and self.metrics is not None and member.info is not None:
                        self.metrics.observe_prediction(predicted, output.num_cached_tokens, member.info.block_size)
                    predicted = None  # the first output carries the engine's num_cached_tokens
                    yield output
        finally:
            member.in_flight -= 1
            if request.lora_name is not None:
                member.lora_in_flight[request.lora_name] -= 1
                if not member.lora_in_flight[request.lora_name]:
                    del member.lora_in_flight[request.lora_name]
            self._retire_if_idle(member)

    async def match_prefix(self, block_hashes: Sequence[bytes]) -> PrefixMatch:
        """The answer of the ready engine holding the most of the chain (the least busy among equals):
        what the fleet holds, as one engine would say it."""
        matches = await ask_engines(self._index_clients(), block_hashes, self.index_timeout_s)
        if not matches:
            raise ConnectionError(f"no ready engine in service {self.service}")
        return max(matches.values(), key=lambda m: (m.num_matched_blocks, -(m.num_running + m.num_waiting)))

    def _index_clients(self) -> dict[str, EngineClient]:
        """The ready engines' clients by index id (what EnginesPrefixIndex asks)."""
        return {m.index_id: m.client for m in self.members.values() if m.ready}

    async def _fetch_infos(self, members: Sequence[EngineMember]) -> None:
        """Each member's EngineInfo, asked once (within the index timeout: a member that does not answer
        is routed without a prediction, and asked again next time)."""
        missing = [m for m in members if m.info is None]

        async def fetch(member: EngineMember) -> None:
            try:
                member.info = await asyncio.wait_for(member.client.info(), self.index_timeout_s)
            except (ConnectionError, TimeoutError, EngineDeadError) as e:
                logger.debug("engine %s: no info yet: %s", member.address, e)

        await asyncio.gather(*(fetch(m) for m in missing))

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Aborts each request in flight on the engine streaming it. Ids not in flight are done
        already: finished, or closed early, which aborted them."""
        by_member: dict[int, tuple[EngineMember, list[str]]] = {}
        for request_id in request_ids:
            if (member := self._owners.get(request_id)) is not None:
                by_member.setdefault(id(member), (member, []))[1].append(request_id)
        await asyncio.gather(*(member.client.abort(ids) for member, ids in by_member.values()))

    async def info(self) -> EngineInfo:
        """The first ready engine's that answers, healthy ones first (they serve one model): one
        engine that stays down (its supervisor gave up on it) must not stop a processor starting."""
        ready = sorted((m for m in self.members.values() if m.ready), key=lambda m: not m.healthy)
        if not ready:
            raise ConnectionError(f"no ready engine in service {self.service}")
        for member in ready[:-1]:
            try:
                return await member.client.info()
            except (ConnectionError, TimeoutError, EngineDeadError) as e:
                logger.debug("engine %s: no info: %s", member.address, e)
        return await ready[-1].client.info()

    async def stats(self) -> EngineStats:
        """The ready engines' stats, summed (their adapters joined)."""
        ready = [m for m in self.members.values() if m.ready]
        stats = await asyncio.gather(*(m.client.stats() for m in ready))
        return EngineStats(**{f.name: sum(getattr(s, f.name) for s in stats) for f in fields(EngineStats)
                              if f.name != "lora"}, lora=_joined([s.lora for s in stats if s.lora is not None]))

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """On every ready engine, or none: a failure unloads it from those that took it, and raises
        the first engine's error (ValueError for a bad folder or a name in use)."""
        ready = self._ready_or_fail()
        results = await asyncio.gather(*(m.client.load_lora_adapter(lora_name, lora_path) for m in ready),
                                       return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        self._forget_stats(ready)
        if not failed:
            self.runtime_loras[lora_name] = lora_path
            return
        loaded = [m for m, r in zip(ready, results) if not isinstance(r, BaseException)]
        undone = await asyncio.gather(*(m.client.unload_lora_adapter(lora_name) for m in loaded),
                                      return_exceptions=True)
        for member, result in zip(loaded, undone):
            if isinstance(result, BaseException):
                logger.warning("engine %s keeps LoRA adapter %s after a failed load: %s", member.address,
                               lora_name, result)
        raise failed[0]

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """From every ready engine; ModelNotFoundError when none served it (an engine that restarted
        since the load does not: that is no failure)."""
        ready = self._ready_or_fail()
        self.runtime_loras.pop(lora_name, None)  # no engine gets it again, whatever they answer
        results = await asyncio.gather(*(m.client.unload_lora_adapter(lora_name) for m in ready),
                                       return_exceptions=True)
        self._forget_stats(ready)
        errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, ModelNotFoundError)]
        if errors:
            raise errors[0]
        if all(isinstance(r, ModelNotFoundError) for r in results):
            raise ModelNotFoundError(lora_name)

    def _ready_or_fail(self) -> list[EngineMember]:
        ready = [m for m in self.members.values() if m.ready]
        if not ready:
            raise ConnectionError(f"no ready engine in service {self.service}")
        return ready

    @staticmethod
    def _forget_stats(members: Sequence[EngineMember]) -> None:
        """Their adapters changed: the next LoRA request reads them again."""
        for member in members:
            member.stats_read_at = float("-inf")

    async def is_healthy(self) -> bool:
        """True while at least one ready engine says SERVING; records each one's answer for choose()."""
        ready = [m for m in self.members.values() if m.ready]
        for member, healthy in zip(ready, await asyncio.gather(*(m.client.is_healthy() for m in ready))):
            if healthy != member.healthy:
                logger.log(logging.INFO if healthy else logging.WARNING, "engine %s is %s", member.endpoint.address,
                           "healthy" if healthy else "unhealthy")
            member.healthy = healthy
        return any(m.healthy for m in ready)

    async def close(self) -> None:
        refreshes = [*(m.stats_refresh for m in self.members.values() if m.stats_refresh is not None), *self._reloads]
        for task in refreshes:
            task.cancel()
        await asyncio.gather(*refreshes, return_exceptions=True)
        await asyncio.gather(*(m.client.close() for m in self.members.values()), *self._closing)
        self.members.clear()

    def _retire_if_idle(self, member: EngineMember) -> None:
        if member.ready or member.in_flight or self.members.get(member.endpoint.address) is not member:
            return
        del self.members[member.endpoint.address]
        task = asyncio.create_task(member.client.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        logger.info("engine %s retired", member.endpoint.address)


def _joined(states: Sequence[LoRAState]) -> LoRAState | None:
    """The adapters of several engines as one pool's (None: none has LoRA on)."""
    if not states:
        return None

    def union(name: str) -> tuple[str, ...]:
        return tuple(sorted({a for s in states for a in getattr(s, name)}))

    return LoRAState(union("adapters"), union("running"), union("waiting"), union("loaded"),
                     sum(s.max_loras for s in states), sum(s.num_deferred for s in states))
