"""The real worker and engine processes on loopback, driven by GrpcEngineClient: the same greedy
tokens as the in-process LLM, cancellation that frees every block, a killed worker that fails
streams and health at once (then the engine exits 1), SIGTERM that stops both quickly."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services import LLM, SamplingParams
from services.common.engine_output import EngineCoreRequest
from services.common.errors import EngineDeadError
from services.engine.client import GrpcEngineClient
from tests.services.procs import ServiceStack as Stack, grpc_health_status, running_stack

KV_BYTES = 64 * 2**20
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time, in a small village by the sea,",
           "import numpy as np\n\ndef softmax(x):"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)
ENDLESS = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)


def start_stack(served_model: str, exits: ExitStack, **engine: Any) -> Stack:
    return exits.enter_context(running_stack(worker=dict(model=served_model, dtype="float32", kv_cache_memory=KV_BYTES),
                                             engine=dict(max_num_batched_tokens=64, **engine)))


@pytest.fixture(scope="module")
def stack(served_model: str) -> Iterator[Stack]:
    with ExitStack() as exits:
        yield start_stack(served_model, exits)


@pytest.fixture(scope="module")
def offline(served_model: str) -> Iterator[LLM]:
    llm = LLM(model=served_model, dtype="float32", kv_cache_memory=KV_BYTES, max_num_batched_tokens=64)
    yield llm
    del llm
    gc.collect()


def engine_requests(llm: LLM, params: SamplingParams, prefix: str) -> list[EngineCoreRequest]:
    """The same EngineCoreRequests (token ids, eos ids) the in-process processor makes."""
    return [llm.processor.make_requests(f"{prefix}{i}", llm.processor.tokenize(p), params)[0]
            for i, p in enumerate(PROMPTS)]


async def wait_for(predicate, timeout: float, period: float = 0.05):
    async with asyncio.timeout(timeout):
        while not (result := await predicate()):
            await asyncio.sleep(period)
        return result


async def idle(client: GrpcEngineClient) -> bool:
    stats = await client.stats()
    return stats.num_running == stats.num_waiting == stats.num_used_blocks == 0


def test_greedy_tokens_match_the_in_process_llm(stack: Stack, offline: LLM):
    expected = offline.generate(PROMPTS, GREEDY)

    async def main():
        client = GrpcEngineClient(stack.engine.address, timeout=10)

        async def collect(request):
            outs = [o async for o in client.generate(request)]
            return [t for o in outs for t in o.new_token_ids], outs[-1].finish_reason

        async with asyncio.timeout(120):
            results = await asyncio.gather(*(collect(r) for r in engine_requests(offline, GREEDY, "greedy-")))
        info = await client.info()
        await wait_for(lambda: idle(client), timeout=5)
        await client.close()
        return results, info

    results, info = asyncio.run(main())
    assert [r[0] for r in results] == [e.outputs[0].token_ids for e in expected]
    assert [r[1] for r in results] == [e.outputs[0].finish_reason for e in expected]
    assert (info.model_id, info.max_model_len, info.block_size) == (
        offline.engine.model_id, offline.engine.max_model_len, 16)


def test_cancelling_a_stream_aborts_the_request_and_frees_its_blocks(stack: Stack, offline: LLM):
    request = engine_requests(offline, ENDLESS, "cancel-")[2]

    async def main():
        client = GrpcEngineClient(stack.engine.address, timeout=10)
        stream = client.generate(request)
        async with asyncio.timeout(60):
            got = [await anext(stream), await anext(stream)]
        assert all(len(o.new_token_ids) == 1 and not o.finished for o in got)
        stats = await client.stats()
        assert stats.num_running == 1 and stats.num_used_blocks > 0
        await stream.aclose()  # the client goes away: the call is cancelled
        await wait_for(lambda: idle(client), timeout=5)
        await client.close()

    asyncio.run(main())


def test_abort_rpc_ends_the_stream(stack: Stack, offline: LLM):
    request = engine_requests(offline, ENDLESS, "abort-")[0]

    async def main():
        client = GrpcEngineClient(stack.engine.address, timeout=10)
        stream = client.generate(request)
        async with asyncio.timeout(60):
            await anext(stream)
            await client.abort([request.request_id, "never-existed"])
            rest = [o async for o in stream]
        assert rest[-1].finish_reason == "abort"
        await wait_for(lambda: idle(client), timeout=5)
        await client.close()

    asyncio.run(main())


def test_invalid_request_is_invalid_argument(stack: Stack, offline: LLM):
    too_long = EngineCoreRequest("too-long", [1] * offline.engine.max_model_len, GREEDY)

    async def main():
        client = GrpcEngineClient(stack.engine.address, timeout=10)
        with pytest.raises(ValueError, match="context"):  # as the in-process engine raises
            async with asyncio.timeout(10):
                [o async for o in client.generate(too_long)]
        await client.close()

    asyncio.run(main())


def test_health_and_reflection_name_the_services(stack: Stack):
    for service, name in ((stack.worker, "kvmesh.v1.Worker"), (stack.engine, "kvmesh.v1.Engine")):
        assert grpc_health_status(service.address, service=name) == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(service.address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                timeout=5)
            names = {s.name for reply in replies for s in reply.list_services_response.service}
        assert {name, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_sigterm_stops_engine_then_worker_within_seconds(stack: Stack):
    # Last in the module: it ends the shared stack.
    assert stack.engine.terminate(timeout=10) == 0, stack.engine.log()
    assert stack.worker.terminate(timeout=10) == 0, stack.worker.log()


def test_killed_worker_fails_streams_health_and_new_requests_fast(served_model: str, offline: LLM):
    """Then, after its --exit-grace (long here, to look at the dead engine), the engine exits 1."""
    requests = engine_requests(offline, ENDLESS, "doomed-")[:2]
    with ExitStack() as exits:
        stack = start_stack(served_model, exits, exit_grace=5)

        async def main():
            client = GrpcEngineClient(stack.engine.address, timeout=5)
            streams = [client.generate(r) for r in requests]
            async with asyncio.timeout(60):
                for s in streams:
                    await anext(s)
                    await anext(s)
            stack.worker.kill()  # kill -9, mid-stream
            errors = []
            for s in streams:
                with pytest.raises(EngineDeadError) as err:
                    async with asyncio.timeout(10):
                        async for _ in s:
                            pass
                errors.append(err.value)
            await wait_for(lambda: _not(client.is_healthy()), timeout=5)
            stats = await client.stats()
            start = time.monotonic()
            with pytest.raises(EngineDeadError) as late:
                async with asyncio.timeout(5):
                    await anext(client.generate(engine_requests(offline, GREEDY, "late-")[0]))
            elapsed = time.monotonic() - start
            await client.close()
            return errors, stats, late.value, elapsed

        errors, stats, late, elapsed = asyncio.run(main())
        for err in errors:
            assert "engine step failed" in str(err), err
        assert (stats.num_running, stats.num_waiting, stats.num_used_blocks) == (0, 0, 0)
        assert elapsed < 1.0, (late, elapsed)
        assert "ConnectionError" in stack.engine.log()  # the reason (the worker is gone) is in the log
        assert grpc_health_status(stack.engine.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert stack.engine.proc.wait(15) == 1, stack.engine.log()


async def _not(awaitable) -> bool:
    return not await awaitable
