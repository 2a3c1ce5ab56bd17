"""The decider of disaggregated prefill/decode, decode-first: an EngineClient over the
decode engine(s) that gives a request a prefill engine only when the decode side would have to
compute more than `threshold` prompt tokens itself.

    a structured-output constraint                               -> constrained: the decode engine
                                                                    computes it (the grammar that
                                                                    masks the first token lives there)
    a LoRA adapter                                               -> adapter: the decode engine computes
                                                                    it (adapters loaded at run time
                                                                    reach the decode engines only)
    prompt tokens <= threshold                                   -> short:  the decode engine computes it
    prompt tokens - tokens the decode side holds <= threshold    -> cached: the decode engine computes it
    else                                                         -> remote: a prefill engine (in turn)

The decode engine is still chosen by the router as for any request (prefix and load: the EngineSet
under this decider, or the one engine); the decider only names a prefill engine, and the decode
engine transfers only the blocks it lacks (services/engine/disaggregation.py). What the decode
side holds is asked of it (Engine.MatchPrefix: an EngineSet answers for its best-placed engine)
only for prompts longer than the threshold, within `index_timeout` seconds; no answer counts as
nothing cached.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import replace

from services.common.clients import EngineClient, EngineInfo, EngineStats, PrefixMatch
from services.common.engine_output import EngineCoreOutput, EngineCoreRequest
from services.common.errors import EngineDeadError, InternalError
from services.processor.metrics import DeciderMetrics
from services.processor.router import predicted_cached_tokens, prompt_chain

OUTCOMES = ("constrained", "adapter", "short", "cached", "remote")


def outcome_of(num_prompt_tokens: int, num_cached_tokens: int, threshold: int) -> str:
    """The outcome for a prompt of which the decode side holds `num_cached_tokens` (see the module docstring)."""
    if num_prompt_tokens <= threshold:
        return "short"
    if num_prompt_tokens - num_cached_tokens <= threshold:
        return "cached"
    return "remote"


class PrefillDecider:
    def __init__(self, decode: EngineClient, prefill_addresses: Sequence[str], threshold: int,
                 metrics: DeciderMetrics | None = None, index_timeout: float = 0.5) -> None:
        if not prefill_addresses:
            raise ValueError("the prefill decider needs at least one prefill engine address")
        self.decode = decode
        self.threshold = threshold
        self.metrics = metrics
        self.index_timeout = index_timeout
        self._prefill = itertools.cycle(prefill_addresses)
        self._info: EngineInfo | None = None
        self.outcomes = dict.fromkeys(OUTCOMES, 0)

    async def decide(self, request: EngineCoreRequest) -> EngineCoreRequest:
        """`request`, with a prefill engine when it should be prefilled there."""
        if request.sampling_params.structured_outputs is not None:
            return self._record(request, "constrained")
        if request.lora_name is not None:
            return self._record(request, "adapter")
        num_tokens = len(request.prompt_token_ids)
        # The decode side is asked what it holds only when the answer could matter.
        cached = 0 if num_tokens <= self.threshold else await self._cached_tokens(request)
        outcome = outcome_of(num_tokens, cached, self.threshold)
        if outcome == "remote":
            request = replace(request, prefill_engine_address=next(self._prefill))
        return self._record(request, outcome)

    def _record(self, request: EngineCoreRequest, outcome: str) -> EngineCoreRequest:
        self.outcomes[outcome] += 1
        if self.metrics is not None:
            self.metrics.decisions[outcome].inc()
        return request

    async def _cached_tokens(self, request: EngineCoreRequest) -> int:
        """Tokens of the prompt the decode side holds cached (0 when it does not say in time)."""
        try:
            if self._info is None:
                self._info = await asyncio.wait_for(self.decode.info(), self.index_timeout)
            match = await asyncio.wait_for(self.decode.match_prefix(prompt_chain(request, self._info)),
                                           self.index_timeout)
        except (ConnectionError, TimeoutError, EngineDeadError, InternalError):
            return 0
        return predicted_cached_tokens(match.num_matched_blocks, len(request.prompt_token_ids), self._info.block_size)

    # ------------------------------------------------------------------ EngineClient

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        request = await self.decide(request)
        async with aclosing(self.decode.generate(request)) as stream:
            async for output in stream:
                yield output

    async def info(self) -> EngineInfo:
        return await self.decode.info()

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self.decode.abort(request_ids)

    async def stats(self) -> EngineStats:
        return await self.decode.stats()

    async def is_healthy(self) -> bool:
        return await self.decode.is_healthy()

    async def match_prefix(self, block_hashes: Sequence[bytes]) -> PrefixMatch:
        return await self.decode.match_prefix(block_hashes)

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        await self.decode.load_lora_adapter(lora_name, lora_path)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        await self.decode.unload_lora_adapter(lora_name)

    async def close(self) -> None:
        await self.decode.close()
