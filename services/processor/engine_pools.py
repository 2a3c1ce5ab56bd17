"""The engines of several models behind one discovery (a static `--engine-address` list, the ready
endpoints of `--engine-service`, or the prefix index's live engines): each engine is asked once which
model it serves, and joins that model's EngineSet, its pool.

    discovery ──update(ready set)──▶ EnginePools ──ask each new engine its model_name (EngineInfo)──┐
                                          │◀───────────────────────────────────────────────────────┘
                                          ├──update(a's engines)──▶ EngineSet "a" (router, prefix index)
                                          └──update(b's engines)──▶ EngineSet "b"

The engines say which model they serve, so a chart with one Deployment per model, or one Service over
all of them, needs no mapping in flags. Each pool routes among its own engines only, so one model's
cached blocks never draw another model's request (their hash chains differ too: the model id is in
every block's hash). An engine that reports a model this processor does not serve is left out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

from services.common.discovery import Endpoint
from services.common.errors import EngineDeadError
from services.processor.engine_set import EngineSet

logger = logging.getLogger(__name__)

PROBE_BACKOFF = (0.25, 5.0)  # seconds: the first wait before asking an engine again, and the longest
MAX_PROBES = 10_000  # asks of one engine while it stays ready, a bound only: hours at the longest wait


class EnginePools:
    """The discovery's subscriber (`update`) that splits its engines into one EngineSet per model.
    `ask_model(address)` is that engine's model name (its EngineInfo.model_name). Construct inside
    the running event loop."""

    def __init__(self, pools: Mapping[str, EngineSet], ask_model: Callable[[str], Awaitable[str]]) -> None:
        self.pools = dict(pools)
        self._ask_model = ask_model
        self.model_of: dict[str, str] = {}  # address -> the model its engine said it serves
        self._ready: dict[str, Endpoint] = {}  # by address: the discovery's ready set
        self._asking: dict[str, asyncio.Task[None]] = {}

    def update(self, endpoints: frozenset[Endpoint]) -> None:
        """The ready set changed: new engines are asked their model, gone ones leave their pool (and are
        asked again should they return: a restarted engine may serve another model)."""
        self._ready = {e.address: e for e in endpoints}
        for address in list(self.model_of):
            if address not in self._ready:
                del self.model_of[address]
        for address in self._ready:
            if address not in self.model_of and address not in self._asking:
                task = asyncio.create_task(self._learn(address), name=f"model-of-{address}")
                self._asking[address] = task
                task.add_done_callback(lambda _, a=address: self._asking.pop(a, None))
        self._publish()

    async def _learn(self, address: str) -> None:
        """Asks the engine at `address` its model until it answers or leaves the ready set."""
        delay = PROBE_BACKOFF[0]
        for _ in range(MAX_PROBES):
            if address not in self._ready:
                return
            try:
                model = await self._ask_model(address)
            except (ConnectionError, TimeoutError, EngineDeadError) as e:  # not up yet
                logger.debug("engine %s: no model name yet: %s", address, e)
            else:
                if address in self._ready:
                    self._join(address, model)
                return
            await asyncio.sleep(delay)
            delay = min(2 * delay, PROBE_BACKOFF[1])

    def _join(self, address: str, model: str) -> None:
        self.model_of[address] = model
        if model not in self.pools:
            logger.warning("engine %s serves %r, which this processor does not (it serves %s): not routed to",
                           address, model, ", ".join(self.pools))
        else:
            logger.info("engine %s serves %s", address, model)
        self._publish()

    def _publish(self) -> None:
        for model, pool in self.pools.items():
            pool.update(frozenset(e for a, e in self._ready.items() if self.model_of.get(a) == model))

    async def close(self) -> None:
        for task in list(self._asking.values()):
            task.cancel()
        await asyncio.gather(*self._asking.values(), return_exceptions=True)
        await asyncio.gather(*(pool.close() for pool in self.pools.values()))
