"""The router: which engine gets an engine request. One policy per `RoutingConfig.routing`:

    round-robin   the next engine in turn
    least-load    the fewest requests queued (ties in turn)
    kv-aware      the lowest cost: the prompt tokens the engine would have to compute (those beyond the
                  prefix it holds cached) + routing_request_cost tokens per request queued on it
    session       the same session id, the same engine while it is ready (rendezvous hashing); none:
                  least-load

kv-aware, in order:
    one candidate                                    -> it                         (only_one)
    busiest - idlest in flight > routing_imbalance   -> the idlest                 (imbalance)
    prefix index unreachable or slower than timeout  -> least-load                 (index_down)
    no candidate holds the prompt's first block      -> least-load                 (no_hit)
    else                                             -> the lowest cost            (prefix_hit)

A request for a LoRA adapter is routed among the engines holding it, under every policy but
round-robin (services/processor/lora_affinity.py); `lora_affinity` when that leaves one.

"Queued" is the larger of what this processor has in flight on the engine and what the engine last
told the index (running + waiting, every processor's requests). Those loads change with heartbeats
(every heartbeat_ttl / 3), so they are read from the index at most every `states_max_age` seconds, in
the background: a routing decision costs one index round trip, the prefix lookup. The prompt's hash chain is the
engine's own (services/common/hashing.py over the engine's block size, model id and the request's cache
salt), and the tokens predicted cached are what the engine's get_computed_blocks will hit: whole
matched blocks, never the prompt's last token.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from services.common.clients import EngineInfo
from services.common.config import RoutingConfig
from services.common.engine_output import EngineCoreRequest
from services.common.hashing import BlockHash, hash_token_blocks
from services.prefix_index.index import EngineState, PrefixIndex
from services.processor.lora_affinity import LoRACandidate, adapter_candidates
from services.processor.metrics import ModelRouterMetrics

logger = logging.getLogger(__name__)


# Why each policy chooses what it chooses: the `reason` label of kvmesh_router_decisions_total.
REASONS = {
    "round-robin": ("only_one", "round_robin"),
    "least-load": ("only_one", "lora_affinity", "least_load"),
    "session": ("only_one", "lora_affinity", "session", "least_load"),
    "kv-aware": ("only_one", "lora_affinity", "imbalance", "no_index", "index_down", "no_hit", "prefix_hit"),
}


class Candidate(LoRACandidate, Protocol):
    """What the router reads of an engine (services/processor/engine_set.py EngineMember)."""

    @property
    def address(self) -> str: ...
    @property
    def index_id(self) -> str: ...  # its id in the prefix index
    in_flight: int
    info: EngineInfo | None  # None until fetched: no prediction for it


class Route(NamedTuple):
    candidate: Candidate
    reason: str
    predicted_cached_tokens: int | None  # None: no lookup behind this choice


def predicted_cached_tokens(num_matched_blocks: int, num_prompt_tokens: int, block_size: int) -> int:
    """The tokens the engine's get_computed_blocks will hit: whole blocks, at most num_tokens - 1."""
    return min(num_matched_blocks, (num_prompt_tokens - 1) // block_size) * block_size


def prompt_chain(request: EngineCoreRequest, info: EngineInfo) -> list[BlockHash]:
    """The block-hash chain the engine `info` describes gives the request's prompt: the engine's own
    (services/engine/request.py hashes the same tokens with the same block size, model id and salt)."""
    return hash_token_blocks(request.prompt_token_ids, info.block_size, info.model_id, request.cache_salt,
                             lora_name=request.lora_name)


def session_score(session_id: str, address: str) -> bytes:
    """Rendezvous hashing: the session goes to the candidate of the highest score, so losing one engine
    moves only that engine's sessions."""
    return hashlib.sha256(f"{session_id}\0{address}".encode()).digest()


STATES_MAX_AGE = 0.25  # seconds; see the module docstring


class Router:
    def __init__(self, config: RoutingConfig, index: PrefixIndex | None = None,
                 index_timeout_s: float = 0.5, metrics: ModelRouterMetrics | None = None,
                 states_max_age: float = STATES_MAX_AGE) -> None:
        """`states_max_age` 0: the engines' states are read with every lookup (tests that change loads)."""
        self.config = config
        self.index = index  # kv-aware only; None: kv-aware routes by load
        self.index_timeout_s = index_timeout_s
        self.metrics = metrics
        self._turn = 0  # round-robin position, and the tie-breaker of the others
        self._index_down = False  # logged once per outage
        self.states_max_age = states_max_age
        self._states: dict[str, EngineState] = {}  # the index's engine states as last read
        self._states_read_at: float | None = None  # time.monotonic(); None: never read
        self._states_refresh: asyncio.Task[None] | None = None

    async def route(self, candidates: Sequence[Candidate], request: EngineCoreRequest) -> Route:
        """The engine for `request` among `candidates` (non-empty: ready, healthy first, none excluded)."""
        assert candidates, "no candidate to route to"
        start = time.perf_counter()
        candidates = sorted(candidates, key=lambda c: c.address)  # a stable order for turns and ties
        policy = self.config.routing
        affine = len(candidates) > 1 and request.lora_name is not None and policy != "round-robin"
        if affine:
            candidates = adapter_candidates(candidates, request.lora_name, self.config.routing_imbalance)
        if len(candidates) == 1:
            route = Route(candidates[0], "lora_affinity" if affine else "only_one", None)
        elif policy == "round-robin":
            route = Route(self._in_turn(candidates), "round_robin", None)
        elif policy == "least-load" or (policy == "session" and not request.session_id):
            route = Route(self._least_loaded(candidates, {}), "least_load", None)
        elif policy == "session":
            route = Route(max(candidates, key=lambda c: session_score(request.session_id, c.address)), "session",
                          None)
        else:
            route = await self._kv_aware(candidates, request)
        if self.metrics is not None:
            self.metrics.observe_decision(policy, route.reason, time.perf_counter() - start)
        return route

    async def _kv_aware(self, candidates: list[Candidate], request: EngineCoreRequest) -> Route:
        in_flight = [c.in_flight for c in candidates]
        if max(in_flight) - min(in_flight) > self.config.routing_imbalance:
            return Route(self._least_loaded(candidates, {}), "imbalance", None)
        if self.index is None:
            return Route(self._least_loaded(candidates, {}), "no_index", None)
        try:
            async with asyncio.timeout(self.index_timeout_s):
                matched, states = await self._lookup(candidates, request)
        except (ConnectionError, TimeoutError) as e:
            if not self._index_down:
                logger.warning("prefix index unavailable, routing by load until it answers: %s", e)
                self._index_down = True
            return Route(self._least_loaded(candidates, {}), "index_down", None)
        if self._index_down:
            logger.info("prefix index answers again: routing by prefix")
            self._index_down = False
        num_tokens = len(request.prompt_token_ids)
        cached = {c.address: predicted_cached_tokens(matched.get(c.address, 0), num_tokens, c.info.block_size)
                  if c.info is not None else 0 for c in candidates}
        queued = {c.address: self._queued(c, states) for c in candidates}
        if not any(cached.values()):
            chosen = self._least_loaded(candidates, states)
            return Route(chosen, "no_hit", 0 if chosen.info is not None else None)
        cost = {a: num_tokens - cached[a] + self.config.routing_request_cost * queued[a] for a in cached}
        best = min(cost.values())
        chosen = self._in_turn([c for c in candidates if cost[c.address] == best])
        return Route(chosen, "prefix_hit", cached[chosen.address] if chosen.info is not None else None)

    async def _lookup(self, candidates: list[Candidate],
                      request: EngineCoreRequest) -> tuple[dict[str, int], dict[str, EngineState]]:
        """Matched blocks by candidate address, and the engines' states by index id. One index lookup per
        distinct (block size, model id): engines of one model normally share it."""
        groups: dict[tuple[int, str], list[Candidate]] = {}
        for c in candidates:
            if c.info is not None:
                groups.setdefault((c.info.block_size, c.info.model_id), []).append(c)
        matched: dict[str, int] = {}
        for group in groups.values():
            chain = prompt_chain(request, group[0].info)
            held = await self.index.longest_prefix(chain) if chain else {}
            matched.update({c.address: held.get(c.index_id, 0) for c in group})
        return matched, await self._engine_states()

    async def _engine_states(self) -> dict[str, EngineState]:
        """The engines' states: read now the first time (and always with states_max_age 0), later
        re-read in the background once older than states_max_age, the last read serving meanwhile."""
        if self._states_read_at is None or self.states_max_age <= 0:
            await self._read_states()
        elif (time.monotonic() - self._states_read_at > self.states_max_age
              and (self._states_refresh is None or self._states_refresh.done())):
            self._states_refresh = asyncio.create_task(self._refresh_states())
        return self._states

    async def _read_states(self) -> None:
        self._states = await self.index.engines()
        self._states_read_at = time.monotonic()

    async def _refresh_states(self) -> None:
        try:
            async with asyncio.timeout(self.index_timeout_s):
                await self._read_states()
        except (ConnectionError, TimeoutError) as e:  # the lookups say when the index is down
            logger.debug("could not refresh the engines' states: %s", e)

    @staticmethod
    def _queued(candidate: Candidate, states: dict[str, EngineState]) -> int:
        state = states.get(candidate.index_id)
        reported = state.load.num_running + state.load.num_waiting if state is not None and state.load else 0
        return max(candidate.in_flight, reported)

    def _least_loaded(self, candidates: list[Candidate], states: dict[str, EngineState]) -> Candidate:
        queued = {c.address: self._queued(c, states) for c in candidates}
        fewest = min(queued.values())
        return self._in_turn([c for c in candidates if queued[c.address] == fewest])

    def _in_turn(self, candidates: list[Candidate]) -> Candidate:
        chosen = candidates[self._turn % len(candidates)]
        self._turn += 1
        return chosen
