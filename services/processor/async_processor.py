"""The processor core served asynchronously: one OpenAI-level request in, merged text deltas out.

The same RequestState as the offline `LLM` (prompts, engine requests, detokenization and stop
strings, the deltas), driven by engine streams instead of `EngineCore.step()`:

    generate(request) ── RequestState: tokenize, validate, n choices (`{id}-{i}`, seed + i)
        ├── pump choice 0: engine.generate(req 0) ─┐
        ├── pump choice 1: engine.generate(req 1) ─┼──▶ queue ──▶ RequestState.apply ──▶ GenerateDelta
        └── ...                                    ─┘

A beam search request (`use_beam_search`) is stepped by services/processor/beam_search.py instead:
each step's beams go to the engine at once as one-token requests, and the answer is one delta.

Tokenizing, chat templates and /detokenize run on a bounded pool of threads, never on the event
loop, so that one long prompt does not stall every other stream's deltas; what one request may
make them do is bounded by the prompt's size (services/common/prompt_size.py), so a request whose
caller went away (its await cancelled) holds its thread for a bounded time only.

Whatever ends the caller's iteration early (a stop string, the client going away, an engine error)
cancels the pumps, which closes their engine streams, and aborts the choices still running.

vllm:request_success is counted here, not in the engine, as vLLM's frontend counts it: once per
engine request, by the finish reason the client sees. Only the processor sees stop strings, and
the engine may finish a choice by length before the processor's abort reaches it. Choices still
running when a request ends early count "abort" (the caller went away) or "error" (the engine
failed). Beam search counts each step's one-token requests, as vLLM's beam search does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Any, TypeVar

from services.common.clients import (
    ChoiceDelta,
    EngineClient,
    EngineInfo,
    GenerateDelta,
    GenerateRequest,
    Tokenized,
    TokenizeRequest,
)
from services.common.engine_output import EngineCoreOutput, EngineCoreRequest
from services.processor.beam_search import BeamSearch
from services.processor.metrics import ProcessorMetrics
from services.processor.processor import Processor
from services.processor.request_state import Choice, RequestState

logger = logging.getLogger(__name__)
T = TypeVar("T")
DEFAULT_TOKENIZER_THREADS = 4


class AsyncProcessor:
    """Implements `ProcessorClient` in-process over an `EngineClient`."""

    def __init__(self, processor: Processor, engine: EngineClient, metrics: ProcessorMetrics | None = None,
                 tokenizer_threads: int = DEFAULT_TOKENIZER_THREADS) -> None:
        self.processor = processor
        self.engine = engine
        self.metrics = metrics
        self._cleanups: set[asyncio.Task[None]] = set()  # strong references until they finish
        self._tokenizer_pool = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="tokenizer")

    async def _off_loop(self, work: Callable[..., T], *args: object) -> T:
        """`work(*args)` on the tokenizer threads. Cancelled, the caller returns at once; the thread
        finishes the (bounded) work and drops it."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, work, *args)

    def close(self) -> None:
        """Lets the tokenizer threads go (work already started finishes)."""
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    async def model_info(self, model: str = "") -> EngineInfo:
        """Its engine's info; `model` is for ProcessorClient's sake (ModelProcessors picks by it)."""
        return await self.engine.info()

    async def is_healthy(self) -> bool:
        """Healthy only while the engine (and through it, its workers) answers."""
        return await self.engine.is_healthy()

    async def tokenize(self, request: TokenizeRequest) -> Tokenized:
        token_ids = await self._off_loop(self.processor.prompt_of, request)
        strs = await self._off_loop(self.processor.token_strs, token_ids) if request.return_token_strs else None
        return Tokenized(token_ids, self.processor.max_model_len, strs)

    async def tokenizer_info(self, model: str = "") -> dict[str, Any]:
        return self.processor.tokenizer_config()

    async def detokenize(self, token_ids: Sequence[int], model: str = "") -> str:
        return await self._off_loop(self.processor.detokenize, token_ids)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Deltas until every choice finished; the first carries the prompt. Raises ValueError for
        invalid input (before any delta), and the engine client's errors as they come."""
        if request.use_beam_search:
            yield await self._beam_search(request)
            return
        start = time.perf_counter()
        state = await self._off_loop(RequestState, self.processor, request)
        if self.metrics is not None:
            self.metrics.tokenize_seconds.observe(time.perf_counter() - start)
        queue: asyncio.Queue[tuple[Choice, EngineCoreOutput | Exception]] = asyncio.Queue()
        pumps = [asyncio.create_task(self._pump(c, queue), name=f"pump-{c.request.request_id}")
                 for c in state.choices]
        try:
            while not state.finished:
                batch = [await queue.get()]
                while not queue.empty():  # every output that arrived meanwhile goes into one delta
                    batch.append(queue.get_nowait())
                deltas: list[ChoiceDelta] = []
                for choice, item in batch:
                    if isinstance(item, Exception) and not choice.finished:
                        raise item
                    start = time.perf_counter()
                    delta = state.apply(choice.index, item) if isinstance(item, EngineCoreOutput) else None
                    if delta is None:
                        continue
                    if self.metrics is not None:
                        self.metrics.detokenize_seconds.observe(time.perf_counter() - start)
                    deltas.append(delta)
                    if choice.finished:  # as the client sees it: a stop string's "stop", whatever the engine said
                        self._count_finished([delta.finish_reason])
                    if choice.stopped_by_string:  # the engine does not know: abort its request
                        self._abort_soon([pumps[choice.index]], [choice.request.request_id])
                if state.finished and self.metrics is not None:
                    self.metrics.observe_finished([c.state.num_output_tokens for c in state.choices])
                if deltas:
                    yield state.delta(deltas, [out for _, out in batch if isinstance(out, EngineCoreOutput)])
        except BaseException as e:
            self._count_finished([_early_end(e)] * len(state.running_ids()))
            raise
        finally:
            await self._release(pumps, state.running_ids())

    async def _beam_search(self, request: GenerateRequest) -> GenerateDelta:
        """The whole answer of a beam search, in one delta. Each step's beams go to the engine at
        once, one task each, so that they are scheduled in one batch; whatever ends the search
        early (the caller went away, an engine error) aborts the step's requests still running."""
        search = await self._off_loop(BeamSearch, self.processor, request)
        while not search.finished:
            requests = search.step_requests()
            steps = [asyncio.create_task(self._one_token(r), name=f"beam-{r.request_id}") for r in requests]
            try:
                outputs = await asyncio.gather(*steps)
            except BaseException as e:  # aborts are idempotent: every request of the step, finished or not
                done = [s.result().finish_reason for s in steps if s.done() and not s.cancelled() and not s.exception()]
                self._count_finished([*done, *[_early_end(e)] * (len(steps) - len(done))])
                await self._release(steps, [r.request_id for r in requests])
                raise
            self._count_finished([out.finish_reason for out in outputs])
            search.advance(outputs)
        return await self._off_loop(search.result)

    async def _one_token(self, request: EngineCoreRequest) -> EngineCoreOutput:
        """The final output of a one-token engine request."""
        async with aclosing(self.engine.generate(request)) as stream:
            async for out in stream:
                if out.finished:
                    return out
        raise ConnectionError(f"the engine stream of {request.request_id} ended before it finished")

    async def _pump(self, choice: Choice, queue: asyncio.Queue) -> None:
        """Forwards one engine stream to `queue`; errors too, so the merging loop raises them."""
        try:
            finished = False
            async with aclosing(self.engine.generate(choice.request)) as stream:
                async for out in stream:
                    queue.put_nowait((choice, out))
                    finished = out.finished
                    if finished:
                        break
            if not finished:
                raise ConnectionError(f"the engine stream of {choice.request.request_id} ended before it finished")
        except Exception as e:  # handed to the merging loop, which raises it to the caller
            queue.put_nowait((choice, e))

    async def _release(self, pumps: list[asyncio.Task[None]], running: list[str]) -> None:
        """Stops the pumps and aborts the choices still running in the engine.

        In a task of its own, shielded: the caller may be cancelled (the client went away), and
        under anyio's level cancellation every await of a cancelled caller fails at once.
        """
        pending = [p for p in pumps if not p.done()]
        if pending or running:
            for p in pending:
                p.cancel()
            await asyncio.shield(self._abort_soon(pending, running))

    def _abort_soon(self, pumps: list[asyncio.Task[None]], running: list[str]) -> asyncio.Task[None]:
        task = asyncio.create_task(self._abort(pumps, running))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        return task

    async def _abort(self, pumps: list[asyncio.Task[None]], running: list[str]) -> None:
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)  # their streams are closed: the engine aborts
        if running:
            try:
                await self.engine.abort(running)  # and once more explicitly: aborts are idempotent
            except Exception as e:  # the engine may be the reason we stopped; nothing left to free then
                logger.warning("could not abort %s in the engine: %s", running, e)

    def _count_finished(self, finish_reasons: list[str]) -> None:
        if self.metrics is not None:
            self.metrics.count_finished(finish_reasons)


def _early_end(error: BaseException) -> str:
    """What the engine requests still running count as when `error` ends a request early: "error"
    when the engine failed (or could not be reached), "abort" when the caller went away (its await
    cancelled, the stream closed)."""
    return "error" if isinstance(error, Exception) else "abort"
