"""The processor core served asynchronously: one OpenAI-level request in, merged text deltas out.

Same objects as the offline `LLM` (`Processor` for prompts and engine requests, one
`RequestOutputState` per choice for detokenization and stop strings), driven by engine streams
instead of `EngineCore.step()`:

    generate(request) ── tokenize, validate, make_requests (n choices: `{id}-{i}`, seed + i)
        ├── pump choice 0: engine.generate(req 0) ─┐
        ├── pump choice 1: engine.generate(req 1) ─┼──▶ queue ──▶ RequestOutputState.process ──▶ GenerateDelta
        └── ...                                    ─┘

Whatever ends the caller's iteration early (a stop string, the client going away, an engine error)
cancels the pumps, which closes their engine streams, and aborts the choices still running.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

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
from services.common.model_runner_output import TokenLogprobs
from services.common.sampling_params import SamplingParams
from services.processor.metrics import ProcessorMetrics
from services.processor.output_processor import FINISH_STOP, RequestOutputState
from services.processor.processor import Processor

logger = logging.getLogger(__name__)

FINISH_ERROR = "error"


@dataclass(slots=True)
class _Choice:
    index: int
    request: EngineCoreRequest
    state: RequestOutputState
    num_cached_tokens: int = 0
    finished: bool = False  # as far as this request is concerned (the engine may not know yet)


class AsyncProcessor:
    """Implements `ProcessorClient` in-process over an `EngineClient`."""

    def __init__(self, processor: Processor, engine: EngineClient, metrics: ProcessorMetrics | None = None) -> None:
        self.processor = processor
        self.engine = engine
        self.metrics = metrics
        self._cleanups: set[asyncio.Task[None]] = set()  # strong references until they finish

    async def model_info(self) -> EngineInfo:
        return await self.engine.info()

    async def is_healthy(self) -> bool:
        """Healthy only while the engine (and through it, its workers) answers."""
        return await self.engine.is_healthy()

    def prompt_token_ids(self, request: GenerateRequest | TokenizeRequest) -> list[int]:
        """Tokenizes the one prompt form `request` carries; raises ValueError on bad input."""
        token_ids = request.prompt_token_ids if isinstance(request, GenerateRequest) else None
        forms = [request.prompt is not None, token_ids is not None, request.messages is not None]
        if sum(forms) != 1:
            raise ValueError("exactly one of prompt, prompt_token_ids and messages must be given")
        if request.messages is not None:
            return self.processor.tokenize_chat(request.messages, request.add_generation_prompt,
                                                request.continue_final_message, request.chat_template_kwargs)
        if request.prompt is not None:
            return self.processor.tokenize(request.prompt, request.add_special_tokens)
        return self.processor.tokenize(token_ids)

    async def tokenize(self, request: TokenizeRequest) -> Tokenized:
        token_ids = self.prompt_token_ids(request)
        return Tokenized(token_ids, self.processor.max_model_len,
                         self.processor.token_strs(token_ids) if request.return_token_strs else None)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.processor.detokenize(token_ids)

    def validate_params(self, params: SamplingParams) -> None:
        """Token ids in the parameters must be in the vocabulary (the sampler indexes logits by them)."""
        vocab_size = self.processor.info.vocab_size
        for name, token_ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} has token id {bad[0]}, out of vocabulary (size {vocab_size})")

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Deltas until every choice finished; the first carries the prompt. Raises ValueError for
        invalid input (before any delta), and the engine client's errors as they come."""
        start = time.perf_counter()
        prompt_token_ids = self.processor.truncate(self.prompt_token_ids(request), request.truncate_prompt_tokens)
        if self.metrics is not None:
            self.metrics.tokenize_seconds.observe(time.perf_counter() - start)
        self.validate_params(request.params)
        engine_requests = self.processor.make_requests(request.request_id, prompt_token_ids, request.params,
                                                       request.priority, request.cache_salt)
        choices = [_Choice(i, r, self.processor.output_state(prompt_token_ids, r.sampling_params))
                   for i, r in enumerate(engine_requests)]
        queue: asyncio.Queue[tuple[_Choice, EngineCoreOutput | Exception]] = asyncio.Queue()
        pumps = [asyncio.create_task(self._pump(c, queue), name=f"pump-{c.request.request_id}") for c in choices]
        num_unfinished = len(choices)
        first = True
        # Every choice's engine request computes the prompt logprobs; the first to arrive are sent.
        prompt_logprobs_sent = request.params.prompt_logprobs is None
        try:
            while num_unfinished:
                batch = [await queue.get()]
                while not queue.empty():  # every output that arrived meanwhile goes into one delta
                    batch.append(queue.get_nowait())
                deltas: list[ChoiceDelta] = []
                for choice, item in batch:
                    if choice.finished:
                        continue  # sent by the engine before it saw our abort
                    if isinstance(item, Exception):
                        raise item
                    start = time.perf_counter()
                    delta, abort_engine = self._apply(choice, item)
                    if self.metrics is not None:
                        self.metrics.detokenize_seconds.observe(time.perf_counter() - start)
                    deltas.append(delta)
                    num_unfinished -= choice.finished
                    if abort_engine:  # a stop string ended the choice; the engine does not know
                        self._abort_soon([pumps[choice.index]], [choice.request.request_id], reason="stop")
                if not num_unfinished and self.metrics is not None:
                    self.metrics.observe_finished([c.state.num_output_tokens for c in choices])
                if not deltas:
                    continue
                delta = GenerateDelta(
                    choices=deltas,
                    prompt_token_ids=list(prompt_token_ids) if first else None,
                    num_prompt_tokens=len(prompt_token_ids),
                    num_cached_tokens=max(c.num_cached_tokens for c in choices),
                    num_generated_tokens=sum(c.state.num_output_tokens for c in choices),
                    prompt_text=self._prompt_text(request, prompt_token_ids) if first and request.echo else None,
                )
                prompt_logprobs = next((out.new_prompt_logprobs for _, out in batch
                                        if isinstance(out, EngineCoreOutput) and out.new_prompt_logprobs), None)
                if not prompt_logprobs_sent and prompt_logprobs is not None:
                    self._add_prompt_logprobs(delta, prompt_token_ids, prompt_logprobs)
                    prompt_logprobs_sent = True
                yield delta
                first = False
        finally:
            await self._release(pumps, [c.request.request_id for c in choices if not c.finished])

    def _prompt_text(self, request: GenerateRequest, prompt_token_ids: list[int]) -> str:
        """The prompt as the user wrote it, or as its (maybe truncated) token ids read."""
        if request.prompt is not None and request.truncate_prompt_tokens is None:
            return request.prompt
        return self.processor.tokenizer.decode(prompt_token_ids)

    def _add_prompt_logprobs(self, delta: GenerateDelta, prompt_token_ids: list[int],
                             logprobs: list[TokenLogprobs]) -> None:
        """Entry i is about prompt token i + 1: the first prompt token has none."""
        assert len(logprobs) == len(prompt_token_ids) - 1, (len(logprobs), len(prompt_token_ids))
        decode = self.processor.decode_token
        delta.prompt_logprobs = [None, *logprobs]
        delta.prompt_logprob_tokens = [[decode(prompt_token_ids[0])],
                                       *([decode(t) for t in lp.token_ids] for lp in logprobs)]

    def _apply(self, choice: _Choice, out: EngineCoreOutput) -> tuple[ChoiceDelta, bool]:
        """The choice's delta for one engine output, and whether the engine request must be aborted."""
        if out.finish_reason == FINISH_ERROR:
            raise RuntimeError(f"the engine failed request {out.request_id}")
        if choice.state.num_output_tokens == 0:
            choice.num_cached_tokens = out.num_cached_tokens
        text = choice.state.process(out.new_token_ids, out.finished, out.finish_reason, out.stop_reason,
                                    drop_last_token=out.finish_reason == FINISH_STOP and bool(out.new_token_ids))
        choice.finished = text.finished
        logprobs = list(out.new_logprobs) if choice.request.sampling_params.logprobs is not None else []
        return ChoiceDelta(
            index=choice.index,
            text=text.text,
            token_ids=list(out.new_token_ids),
            logprobs=logprobs,
            finish_reason=text.finish_reason,
            stop_reason=text.stop_reason,
            logprob_tokens=[[self.processor.decode_token(t) for t in lp.token_ids] for lp in logprobs],
        ), text.abort_engine

    async def _pump(self, choice: _Choice, queue: asyncio.Queue) -> None:
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

    def _abort_soon(self, pumps: list[asyncio.Task[None]], running: list[str],
                    reason: str = "abort") -> asyncio.Task[None]:
        task = asyncio.create_task(self._abort(pumps, running, reason))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        return task

    async def _abort(self, pumps: list[asyncio.Task[None]], running: list[str], reason: str = "abort") -> None:
        if reason != "abort":  # say why first: closing the stream aborts it too, as a plain abort
            await self._abort_in_engine(running, reason)
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)  # their streams are closed: the engine aborts
        if reason == "abort":
            await self._abort_in_engine(running, reason)  # and once more explicitly: aborts are idempotent

    async def _abort_in_engine(self, running: list[str], reason: str) -> None:
        if running:
            try:
                await self.engine.abort(running, reason)
            except Exception as e:  # the engine may be the reason we stopped; nothing left to free then
                logger.warning("could not abort %s in the engine: %s", running, e)
