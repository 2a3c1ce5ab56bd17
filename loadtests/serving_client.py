"""The serving benchmark's load generator: streamed chat completions over HTTP, timed per chunk.

One request (`send`): POST /v1/chat/completions with `stream: true`, read the server-sent events as
they arrive, and stamp each content chunk with `time.perf_counter()`. For a base model without a
chat template, an endpoint of `api="completions"` sends the conversation as one plain transcript
(`transcript`) to /v1/completions instead, the way such a model is used:

    start ── role chunk ── first content ── content ── content ── ... ── usage ── end
             (not counted)  TTFT = first - start   ITL = each gap        e2e = end - start

    TPOT = (e2e - TTFT) / (output tokens - 1)

The output and prompt token counts are the server's `usage`; a stream without it is a failed
request (its length could not be checked). A chunk may hold more than one token (the detokenizer holds back an incomplete character), so
ITL is per chunk, TPOT per token. A load (`run_load`) drives sessions (loadtests.serving_scenarios)
either with a fixed number in flight (`concurrency`) or arriving as a seeded Poisson process
(`rate` sessions/s, unbounded in flight); multi-turn sessions send their turns one after another.
Everything is bounded: each request by `timeout` seconds, the whole load by `max_duration`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import httpx2 as httpx

from loadtests.serving_scenarios import Session


@dataclass(frozen=True)
class Endpoint:
    url: str  # http://127.0.0.1:PORT
    model: str  # the "model" every request names (the server's /v1/models id)
    extra_body: dict[str, Any]  # what makes this server emit exactly max_tokens tokens (and report usage)
    api: str = "chat"  # "chat" (/v1/chat/completions) or "completions" (/v1/completions, a plain transcript)


def transcript(messages: Sequence[dict[str, str]]) -> str:
    """The conversation as plain text ending where the assistant speaks next: the prompt of a base
    model, which has no chat template."""
    turns = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(turns + ["Assistant:"])


@dataclass(frozen=True)
class Load:
    concurrency: int | None = None  # sessions in flight, or
    rate: float | None = None  # Poisson arrivals, sessions per second
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("a load has either a concurrency or a rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be positive, got {self.concurrency}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be positive, got {self.rate}")

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.concurrency is not None else f"rate={self.rate:g}/s"


@dataclass(slots=True)
class RequestResult:
    start: float  # perf_counter seconds
    end: float = 0.0
    ttft: float | None = None  # seconds to the first non-empty content chunk
    itl: list[float] = field(default_factory=list)  # seconds between consecutive content chunks
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, found in the engine's prefix cache (usage.prompt_tokens_details)
    answer: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


class LoadResult(NamedTuple):
    requests: list[RequestResult]
    duration: float  # seconds from the first request sent to the last one ended


async def send(client: httpx.AsyncClient, endpoint: Endpoint, messages: list[dict[str, str]], max_tokens: int,
               timeout: float, model: str | None = None) -> RequestResult:
    chat = endpoint.api == "chat"
    body = {"model": model or endpoint.model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            **({"messages": messages} if chat else {"prompt": transcript(messages)}), **endpoint.extra_body}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    result = RequestResult(start=time.perf_counter())
    pieces: list[str] = []
    last = 0.0
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", endpoint.url + path, json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    result.error = f"HTTP {response.status_code}: {text[:300]}"
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    event = json.loads(data)
                    if "error" in event:
                        result.error = f"error event: {json.dumps(event['error'])[:300]}"
                        return result
                    for choice in event.get("choices") or ():
                        content = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                        if not content:
                            continue
                        if result.ttft is None:
                            result.ttft = now - result.start
                        else:
                            result.itl.append(now - last)
                        last = now
                        pieces.append(content)
                    if usage := event.get("usage"):
                        result.output_tokens = usage.get("completion_tokens") or 0
                        result.prompt_tokens = usage.get("prompt_tokens") or 0
                        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except TimeoutError:
        result.error = f"no complete answer within --timeout {timeout:g}s"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.end = time.perf_counter()
    if result.error is None and result.ttft is None:
        result.error = "the stream ended without content"
    if result.error is None and not result.output_tokens:
        result.error = "the stream reported no usage: its length is unknown"
    result.answer = "".join(pieces)
    return result


async def run_session(client: httpx.AsyncClient, endpoint: Endpoint, session: Session, max_tokens: int,
                      timeout: float, results: list[RequestResult]) -> None:
    """The session's requests one after another, each turn carrying the answers so far."""
    messages = list(session.messages)
    for turn in range(session.num_requests):
        result = await send(client, endpoint, messages, max_tokens, timeout, session.model)
        results.append(result)
        if not result.ok:
            skipped = session.num_requests - turn - 1
            results.extend(RequestResult(start=result.end, end=result.end, error="not sent: an earlier turn failed")
                           for _ in range(skipped))
            return
        if turn < len(session.follow_ups):
            messages += [{"role": "assistant", "content": result.answer},
                         {"role": "user", "content": session.follow_ups[turn]}]


async def run_load(endpoint: Endpoint, sessions: Sequence[Session], load: Load, max_tokens: int, timeout: float,
                   max_duration: float) -> LoadResult:
    results: list[RequestResult] = []
    num_requests = sum(s.num_requests for s in sessions)
    limits = httpx.Limits(max_connections=len(sessions), max_keepalive_connections=len(sessions))
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        start = time.perf_counter()
        tasks: list[asyncio.Task] = []
        if load.concurrency is not None:
            pending = iter(sessions)  # shared by the loops below: each takes the next session when free

            async def loop() -> None:
                for session in pending:
                    await run_session(client, endpoint, session, max_tokens, timeout, results)

            tasks = [asyncio.create_task(loop()) for _ in range(min(load.concurrency, len(sessions)))]
        else:
            tasks = [asyncio.create_task(_poisson(client, endpoint, sessions, load, max_tokens, timeout, results))]
        try:
            async with asyncio.timeout(max_duration):
                await asyncio.gather(*tasks)
        except TimeoutError:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        duration = time.perf_counter() - start
    missing = num_requests - len(results)
    results.extend(RequestResult(start=start, end=start, error=f"not finished within --max-duration {max_duration:g}s")
                   for _ in range(missing))
    return LoadResult(results, duration)


async def _poisson(client: httpx.AsyncClient, endpoint: Endpoint, sessions: Sequence[Session], load: Load,
                   max_tokens: int, timeout: float, results: list[RequestResult]) -> None:
    """The first session at once, then one after each exponential gap (mean 1/rate), seeded."""
    rng = random.Random(load.seed)
    running: list[asyncio.Task] = []
    due = time.perf_counter()
    try:
        for session in sessions:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            running.append(asyncio.create_task(run_session(client, endpoint, session, max_tokens, timeout, results)))
            due += rng.expovariate(load.rate)
        await asyncio.gather(*running)
    finally:
        for task in running:
            task.cancel()
