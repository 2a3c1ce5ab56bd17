"""The prefix index without Redis: ask the engines themselves (`Engine.MatchPrefix`), all at once, each
within a short deadline. Exact at the moment of asking (each engine answers from its own block pool),
at the cost of one call per engine per routed request; for a fleet with no shared index.

It reads only: the engines are the index, so there is nothing to apply, heartbeat or sweep. Its
`engines()` answers the loads the engines reported with their last answers (no call of its own).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence

from services.common.clients import EngineClient, PrefixMatch
from services.common.errors import EngineDeadError
from services.common.hashing import BlockHash
from services.common.kv_events import KVCacheEvent
from services.prefix_index.index import EngineLoad, EngineState

logger = logging.getLogger(__name__)


async def ask_engines(engines: Mapping[str, EngineClient], block_hashes: Sequence[BlockHash],
                      timeout_s: float) -> dict[str, PrefixMatch]:
    """Each engine's answer to MatchPrefix within `timeout_s`, by id; an engine that fails or is slow is
    left out. ConnectionError when there were engines to ask and none answered."""
    ids = list(engines)

    async def ask(client: EngineClient) -> PrefixMatch:
        return await asyncio.wait_for(client.match_prefix(block_hashes), timeout_s)

    answers = await asyncio.gather(*(ask(engines[i]) for i in ids), return_exceptions=True)
    matches: dict[str, PrefixMatch] = {}
    for engine_id, answer in zip(ids, answers):
        if isinstance(answer, PrefixMatch):
            matches[engine_id] = answer
        elif isinstance(answer, (ConnectionError, TimeoutError, OSError, EngineDeadError)):
            logger.debug("engine %s did not answer MatchPrefix: %s", engine_id, answer)
        else:
            raise answer  # ValueError for a malformed chain, or a bug: not an unreachable engine
    if ids and not matches:
        raise ConnectionError(f"no engine answered MatchPrefix within {timeout_s}s")
    return matches


class EnginesPrefixIndex:
    """A read-only PrefixIndex over the engines `engines()` names (id -> client) at each lookup."""

    def __init__(self, engines: Callable[[], Mapping[str, EngineClient]], timeout_s: float = 0.5) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self._engines = engines
        self.timeout_s = timeout_s
        self._states: dict[str, EngineState] = {}  # from the last answers

    async def longest_prefix(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        matches = await ask_engines(self._engines(), block_hashes, self.timeout_s)
        self._states = {
            engine_id: EngineState(0, EngineLoad(m.num_running, m.num_waiting, m.num_free_blocks, m.kv_cache_usage))
            for engine_id, m in matches.items()
        }
        return {engine_id: m.num_matched_blocks for engine_id, m in matches.items() if m.num_matched_blocks}

    async def engines(self) -> dict[str, EngineState]:
        return dict(self._states)

    async def apply(self, engine_id: str, epoch: int, events: Sequence[KVCacheEvent]) -> None:
        raise TypeError("EnginesPrefixIndex is read-only: each engine answers from its own block pool")

    async def heartbeat(self, engine_id: str, epoch: int, load: EngineLoad) -> None:
        raise TypeError("EnginesPrefixIndex is read-only: each engine answers from its own block pool")

    async def clear(self, engine_id: str) -> None:
        raise TypeError("EnginesPrefixIndex is read-only: each engine answers from its own block pool")

    async def sweep(self) -> list[str]:
        return []  # nothing is stored, so nothing outlives an engine

    async def close(self) -> None:
        self._states.clear()
