"""The processor streams of one HTTP request (one per prompt), read merged.

    Generation.start(processor, requests)   one pump task per stream -> one queue
    await started()                          every stream's first delta is in: invalid input has
                                             raised by now, so it is a status code, not an error event
    first(i)                                 prompt i's first delta (its prompt ids), once started
    async for i, delta in deltas()           (prompt index, delta) until every stream ended
    usage() / choice_usage(i, c)             token counts so far: of the whole request / of prompt
                                             i's choice c (vLLM's continuous usage)
    end(error)                               from outside: deltas() raises `error` (server shutdown)
    await aclose()                           cancels the pumps, which closes their streams and so
                                             aborts the engine requests

aclose() is shielded from the caller's cancellation: under anyio (Starlette cancels a streaming
response whose client went away) every await of a cancelled task fails at once.

The queue holds at most DELTAS_AHEAD deltas per stream: when the client reads slower than the
engine writes, the pumps wait, and gRPC's flow control holds the processor's stream back, instead
of the gateway buffering the whole answer (a client that stops reading altogether is cut off by
the connection's --send-timeout, services/gateway/connection_guard.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

import anyio

from services.common.clients import GenerateDelta, GenerateRequest, ProcessorClient
from services.gateway.protocol import PromptTokensDetails, Usage

_END = object()
DELTAS_AHEAD = 16  # per stream: deltas read from the processor and not yet taken by the response


class Generation:
    def __init__(self, streams: Sequence[AsyncIterator[GenerateDelta]]) -> None:
        self._queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue(DELTAS_AHEAD * max(1, len(streams)))
        self._ended: Exception | None = None  # by end(), ahead of whatever the queue holds
        self._pumps = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]
        self._remaining = len(streams)
        self._started: list[tuple[int, GenerateDelta]] = []  # read by started(), replayed by deltas()
        self._last: dict[int, GenerateDelta] = {}  # per prompt: its usage counters are cumulative
        self._first: dict[int, GenerateDelta] = {}  # per prompt: its first delta
        self._generated: dict[tuple[int, int], int] = {}  # per (prompt, choice): tokens read by deltas()

    @classmethod
    def start(cls, processor: ProcessorClient, requests: Sequence[GenerateRequest]) -> Generation:
        return cls([processor.generate(r) for r in requests])

    @property
    def num_prompts(self) -> int:
        return len(self._pumps)

    async def started(self) -> bool:
        """Waits for every stream's first delta; raises what a stream raised first. True."""
        seen: set[int] = set()
        while len(seen) < self.num_prompts:
            i, delta = await self._next()
            self._started.append((i, delta))
            self._first.setdefault(i, delta)
            seen.add(i)
        return True

    def first(self, index: int) -> GenerateDelta:
        """Prompt `index`'s first delta; only after started()."""
        return self._first[index]

    async def deltas(self) -> AsyncIterator[tuple[int, GenerateDelta]]:
        while self._started or self._remaining:
            i, delta = self._started.pop(0) if self._started else await self._next()
            if delta is not None:
                self._last[i] = delta
                for c in delta.choices:
                    self._generated[i, c.index] = self._generated.get((i, c.index), 0) + len(c.token_ids)
                yield i, delta

    def usage(self) -> Usage:
        """Token counts of every prompt so far (of the whole request, once deltas() ended)."""
        prompt = sum(d.num_prompt_tokens for d in self._last.values())
        completion = sum(d.num_generated_tokens for d in self._last.values())
        cached = sum(d.num_cached_tokens for d in self._last.values())
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def choice_usage(self, prompt: int, choice: int) -> Usage:
        """Prompt `prompt`'s tokens and its choice `choice`'s so far, as vLLM counts a chunk's
        continuous usage (once started: the first delta has the prompt's count)."""
        num_prompt = self._first[prompt].num_prompt_tokens
        generated = self._generated.get((prompt, choice), 0)
        return Usage(prompt_tokens=num_prompt, completion_tokens=generated, total_tokens=num_prompt + generated)

    def end(self, error: Exception) -> None:
        """Makes the reader raise `error` next (it then closes this generation)."""
        self._ended = error
        if self._queue.empty():  # the reader may be waiting on it: wake it (else it finds _ended first)
            self._queue.put_nowait((-1, error))

    async def aclose(self) -> None:
        for pump in self._pumps:
            pump.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*self._pumps, return_exceptions=True)

    async def _next(self) -> tuple[int, GenerateDelta | None]:
        """The next delta, (i, None) when stream i ended; raises a stream's error."""
        if self._ended is not None:
            raise self._ended
        i, item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        if item is _END:
            self._remaining -= 1
            return i, None
        return i, item

    async def _pump(self, index: int, stream: AsyncIterator[GenerateDelta]) -> None:
        try:
            empty = True
            async with aclosing(stream):
                async for delta in stream:
                    empty = False
                    await self._queue.put((index, delta))  # waits while the reader is DELTAS_AHEAD behind
            if empty:
                raise ConnectionError("the processor ended a stream without any output")
            await self._queue.put((index, _END))
        except Exception as e:  # raised to the reader
            await self._queue.put((index, e))
