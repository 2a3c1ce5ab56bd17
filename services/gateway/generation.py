"""The processor streams of one HTTP request (one per prompt), opened together and read merged.

Opening waits for each stream's first delta, so that invalid input raises (and is answered with a
status code) before a streaming response has started. Closing closes every stream, which aborts
their engine requests; it is shielded from the caller's cancellation, since under anyio (Starlette
cancels a streaming response whose client went away) every await of a cancelled task fails at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import anyio

from services.common.clients import GenerateDelta, GenerateRequest, ProcessorClient
from services.gateway.protocol import PromptTokensDetails, Usage

_END = object()


class Generation:
    def __init__(self, streams: list[AsyncIterator[GenerateDelta]], first: list[GenerateDelta]) -> None:
        self._streams = streams
        self._first = first
        self._last: dict[int, GenerateDelta] = {}  # per prompt: its usage counters are cumulative

    @classmethod
    async def open(cls, processor: ProcessorClient, requests: Sequence[GenerateRequest]) -> Generation:
        streams = [processor.generate(r) for r in requests]
        generation = cls(streams, [])
        firsts = [asyncio.ensure_future(_first_delta(s)) for s in streams]
        try:
            generation._first = list(await asyncio.gather(*firsts))
        except BaseException:
            for first in firsts:
                first.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*firsts, return_exceptions=True)
            await generation.aclose()
            raise
        return generation

    @property
    def num_prompts(self) -> int:
        return len(self._streams)

    def usage(self) -> Usage:
        """Token counts of every prompt so far (of the whole request, once deltas() ended)."""
        prompt = sum(d.num_prompt_tokens for d in self._last.values())
        completion = sum(d.num_generated_tokens for d in self._last.values())
        cached = sum(d.num_cached_tokens for d in self._last.values())
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    async def deltas(self) -> AsyncIterator[tuple[int, GenerateDelta]]:
        """(prompt index, delta) until every stream ended."""
        for i, delta in enumerate(self._first):
            self._last[i] = delta
            yield i, delta
        if len(self._streams) == 1:
            async for delta in self._streams[0]:
                self._last[0] = delta
                yield 0, delta
            return
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(self._pump(i, s, queue)) for i, s in enumerate(self._streams)]
        try:
            remaining = len(pumps)
            while remaining:
                i, item = await queue.get()
                if item is _END:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    self._last[i] = item
                    yield i, item
        finally:
            for pump in pumps:
                pump.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*pumps, return_exceptions=True)

    @staticmethod
    async def _pump(index: int, stream: AsyncIterator[GenerateDelta], queue: asyncio.Queue) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((index, delta))
            queue.put_nowait((index, _END))
        except Exception as e:  # raised to the reader by deltas()
            queue.put_nowait((index, e))

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            for stream in self._streams:
                await stream.aclose()


async def _first_delta(stream: AsyncIterator[GenerateDelta]) -> GenerateDelta:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        raise ConnectionError("the processor ended a stream without any output") from None
