"""Overload over the real processes (worker, engine, processor, gateway on loopback): an engine with
one running slot and one waiting slot, a slow generation, and ten requests at once get exactly two
200s and eight 503s with Retry-After and an OpenAI error body, streamed or not. The engine queues
nothing beyond its bound, and afterwards holds no request and no block."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx2 as httpx
import pytest

from services.common.clients import EngineStats
from services.common.errors import EngineOverloadedError
from services.engine.client import GrpcEngineClient
from services.engine.kv_cache_manager import KVCacheManager
from services.engine.request import RequestStatus
from services.engine.scheduler import Scheduler
from tests.services.procs import ServiceStack, running_stack
from tests.unit.test_scheduler import BLOCK, make_request, step

KV_BYTES = 64 * 2**20
MAX_TOKENS = 64  # a few seconds of decoding on 2 CPU cores: every request arrives while the first runs
SLOW = {"prompt": "Tell me a long story about the sea.", "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(served_model: str) -> Iterator[ServiceStack]:
    with running_stack(worker=dict(model=served_model, dtype="float32", kv_cache_memory=KV_BYTES, max_num_seqs=1),
                       engine=dict(max_num_seqs=1, max_num_waiting=1),
                       processor=dict(model=served_model, served_model_name="smollm2"),
                       gateway=dict(served_model_name="smollm2")) as services:
        yield services


async def engine_stats(address: str) -> EngineStats:
    client = GrpcEngineClient(address, timeout=5)
    try:
        return await client.stats()
    finally:
        await client.close()


def test_a_full_engine_answers_503_with_retry_after_and_drains(stack):
    async def main() -> None:
        async with httpx.AsyncClient(base_url=stack.gateway.url, timeout=120) as client:
            replies = await asyncio.gather(*(client.post("/v1/completions", json={**SLOW, "stream": i % 2 == 1})
                                             for i in range(10)))
            statuses = sorted(r.status_code for r in replies)
            assert statuses == [200] * 2 + [503] * 8, [(r.status_code, r.text[:200]) for r in replies]
            for r in replies:
                if r.status_code == 503:
                    assert r.headers["retry-after"] == "1"
                    error = r.json()["error"]
                    assert set(error) == {"message", "type", "param", "code"}, error
                    assert error["code"] == "overloaded" and "full" in error["message"], error
                elif r.headers["content-type"].startswith("text/event-stream"):
                    events = [line[len("data: "):] for line in r.text.split("\n\n") if line]
                    assert events[-1] == "[DONE]" and "error" not in events[-2], events[-2:]
                    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
                    assert text
                else:
                    assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS

            deadline = time.monotonic() + 15
            while True:
                stats = await engine_stats(stack.engine.address)
                if stats.num_running == stats.num_waiting == stats.num_used_blocks == 0:
                    break
                assert time.monotonic() < deadline, f"the engine still holds requests: {stats}"
                await asyncio.sleep(0.1)
        # Nothing is stuck: the next request is served (on a new connection: uvicorn closes idle ones).
        async with httpx.AsyncClient(base_url=stack.gateway.url, timeout=120) as client:
            r = await client.post("/v1/completions", json={**SLOW, "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2

    asyncio.run(main())


def test_the_scheduler_holds_max_num_seqs_plus_max_num_waiting_requests():
    """Counted over every request held, so the bound does not depend on steps in between; a refused
    request leaves nothing behind, a finished one frees its place."""
    sched = Scheduler(KVCacheManager(64, BLOCK, True), 32, max_num_seqs=1, max_model_len=256, max_num_waiting=1)
    sched.add_request(make_request("a", 6, max_tokens=2))
    sched.add_request(make_request("b", 6, max_tokens=2, first_token=200))
    with pytest.raises(EngineOverloadedError, match="1 more waiting"):
        sched.add_request(make_request("c", 6, first_token=300))
    sched.check_integrity()
    assert set(sched.requests) == {"a", "b"} and sched.num_waiting == 2
    step(sched)  # a runs, b waits: still full
    with pytest.raises(EngineOverloadedError):
        sched.add_request(make_request("c", 6, first_token=300))
    step(sched)  # a finishes
    assert set(sched.requests) == {"b"}
    sched.add_request(make_request("c", 6, first_token=300))
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    sched.add_request(make_request("d", 6, first_token=400))
    sched.check_integrity()
    assert set(sched.requests) == {"c", "d"}
