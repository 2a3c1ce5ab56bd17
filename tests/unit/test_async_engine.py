"""AsyncEngine over a scripted worker: streams, cancellation, aborts between steps, worker failure, idle checks."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Awaitable, Callable

import pytest

from services.common.clients import WorkerInfo
from services.common.config import SchedulerConfig
from services.common.engine_output import EngineCoreRequest
from services.common.errors import EngineDeadError
from services.common.model_runner_output import ModelRunnerOutput
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import SchedulerOutput
from services.engine.async_engine import AsyncEngine

TOKEN = 7


class ScriptedWorker:
    """A WorkerClient that keeps the persistent batch as the real one does (token counts only) and
    samples TOKEN for every request that reaches its last known token."""

    kv_transfer_endpoints: tuple[str, ...] = ()  # as a GroupWorkerClient of workers without KV transfer

    def __init__(self, num_blocks: int = 64) -> None:
        self.num_blocks = num_blocks
        self.requests: dict[str, list[int]] = {}  # req_id -> [num_tokens, num_computed_tokens]
        self.steps: list[SchedulerOutput] = []
        self.fail_with: Exception | None = None
        self.in_step = threading.Event()
        # When set, each step takes one permit (waiting in the step for it): the test decides how far
        # the engine-loop thread, which outruns the event loop by far, may get.
        self.permits: threading.Semaphore | None = None

    def close(self) -> None:
        pass

    def check_alive(self) -> None:  # always alive: it lives in the engine's process
        pass

    def get_info(self) -> WorkerInfo:
        return WorkerInfo(model_id="scripted", model_path="/nowhere", vocab_size=1000, max_model_len=4096, block_size=4)

    def initialize_cache(self, max_num_reqs: int) -> int:
        return self.num_blocks

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        # Runs on the engine-loop thread, as a real worker client does.
        self.steps.append(out)
        self.in_step.set()
        if self.permits is not None:
            assert self.permits.acquire(timeout=5), "the test never allowed this step"
        self.in_step.clear()
        if self.fail_with is not None:
            raise self.fail_with
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.requests[new.req_id] = [len(new.prompt_token_ids) + len(new.output_token_ids), new.num_computed_tokens]
        for cached in out.scheduled_cached_reqs:
            assert self.requests[cached.req_id][1] == cached.num_computed_tokens
        req_ids = []
        for req_id, n in out.num_scheduled_tokens.items():
            state = self.requests[req_id]
            state[1] += n
            if state[1] == state[0]:
                req_ids.append(req_id)
                state[0] += 1
        return ModelRunnerOutput(req_ids, [TOKEN] * len(req_ids))


def request(request_id: str, max_tokens: int = 5, prompt_len: int = 20) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, list(range(1, prompt_len + 1)),
                             SamplingParams(temperature=0, max_tokens=max_tokens), eos_token_ids=(2,))


async def make_engine(worker: ScriptedWorker) -> AsyncEngine:
    return await AsyncEngine.create(worker, SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8))


async def until(predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 2.0) -> None:
    """Polls `predicate` (a plain or an async one) until it holds; TimeoutError after `timeout` s."""
    async with asyncio.timeout(timeout):
        while not await _value(predicate()):
            await asyncio.sleep(0.001)


async def _value(result: bool | Awaitable[bool]) -> bool:
    return await result if inspect.isawaitable(result) else result


async def assert_idle(engine: AsyncEngine, worker: ScriptedWorker) -> None:
    await until(lambda: not worker.requests and not engine.core.has_finished_requests())
    stats = await engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_used_blocks) == (0, 0, 0)
    engine.core.check_integrity()


def test_streams_every_token_then_the_worker_drops_the_request():
    async def main():
        worker = ScriptedWorker()
        engine = await make_engine(worker)
        outputs = {rid: [o async for o in engine.generate(request(rid, max_tokens=3 + i))]
                   for i, rid in enumerate("ab")}
        for rid, outs in outputs.items():
            assert [t for o in outs for t in o.new_token_ids] == [TOKEN] * len(outs)
            assert [o.finish_reason for o in outs][-1] == "length"
        assert (len(outputs["a"]), len(outputs["b"])) == (3, 4)
        await assert_idle(engine, worker)
        assert await engine.is_healthy()
        await engine.shutdown()

    asyncio.run(main())


def test_closing_a_stream_aborts_between_steps_and_frees_every_block():
    async def main():
        worker = ScriptedWorker()
        engine = await make_engine(worker)
        worker.permits = threading.Semaphore(3)  # two chunks of prompt, one decode: two outputs
        stream = engine.generate(request("r", max_tokens=1000))
        got = [await anext(stream), await anext(stream)]
        assert [o.new_token_ids for o in got] == [[TOKEN], [TOKEN]]
        await until(worker.in_step.is_set)  # the next step waits for its permit
        await stream.aclose()  # mid-step: the abort waits for the step to end
        assert "r" in engine.core.scheduler.requests
        worker.permits.release(1000)
        await assert_idle(engine, worker)
        assert "r" in worker.steps[-1].finished_req_ids
        await engine.shutdown()

    asyncio.run(main())


def test_cancelling_the_consumer_aborts_the_request():
    async def main():
        worker = ScriptedWorker()
        engine = await make_engine(worker)
        seen = []

        async def consume():
            async for out in engine.generate(request("r", max_tokens=1000)):
                seen.append(out)

        worker.permits = threading.Semaphore(3)  # two outputs, then the engine waits
        task = asyncio.create_task(consume())
        await until(lambda: len(seen) >= 2)
        task.cancel()
        worker.permits.release(1000)
        with pytest.raises(asyncio.CancelledError):
            await task
        await assert_idle(engine, worker)
        await engine.shutdown()

    asyncio.run(main())


def test_abort_ends_the_stream_with_finish_reason_abort():
    async def main():
        worker = ScriptedWorker()
        engine = await make_engine(worker)
        worker.permits = threading.Semaphore(2)  # the prompt's two chunks, then the engine waits
        stream = engine.generate(request("r", max_tokens=1000))
        await anext(stream)
        await engine.abort(["r", "r", "unknown"])
        worker.permits.release(1000)
        rest = [o async for o in stream]
        assert rest[-1].finish_reason == "abort"
        await assert_idle(engine, worker)
        await engine.shutdown()

    asyncio.run(main())


def test_invalid_and_duplicate_requests_raise_value_error():
    async def main():
        engine = await make_engine(ScriptedWorker())
        with pytest.raises(ValueError, match="empty"):
            await anext(engine.generate(EngineCoreRequest("e", [], SamplingParams())))
        stream = engine.generate(request("dup", max_tokens=1000))
        await anext(stream)
        with pytest.raises(ValueError, match="already in use"):
            await anext(engine.generate(request("dup")))
        await stream.aclose()
        await engine.shutdown()

    asyncio.run(main())


def test_a_failed_step_fails_every_stream_and_every_later_request():
    async def main():
        worker = ScriptedWorker()
        engine = await make_engine(worker)
        worker.permits = threading.Semaphore(0)
        streams = [engine.generate(request(rid, max_tokens=1000)) for rid in "ab"]
        firsts = asyncio.gather(*(anext(s) for s in streams))  # both queued before the first step ends
        await until(worker.in_step.is_set)
        worker.permits.release(4)  # both prompts' chunks and a decode, then the engine waits
        await firsts
        worker.fail_with = RuntimeError("the device fell off the bus")
        worker.permits.release(1000)
        for s in streams:
            with pytest.raises(EngineDeadError, match="engine step failed") as dead:
                async with asyncio.timeout(2):
                    async for _ in s:
                        pass
            # The worker's reason stays in the log and the cause, out of the message callers pass on.
            assert "device fell off the bus" not in str(dead.value)
            assert str(dead.value.__cause__) == "the device fell off the bus"
        assert not await engine.is_healthy()
        async with asyncio.timeout(1):
            await engine.wait_until_unhealthy()
        with pytest.raises(EngineDeadError):
            await anext(engine.generate(request("c")))
        stats = await engine.stats()
        assert (stats.num_running, stats.num_waiting, stats.num_used_blocks) == (0, 0, 0)
        await engine.shutdown()

    asyncio.run(main())


def test_the_engine_takes_its_block_size_from_its_worker():
    async def main():
        worker = ScriptedWorker()  # its blocks hold 4 tokens
        engine = await make_engine(worker)
        assert engine.core.block_size == 4 and (await engine.info()).block_size == 4
        worker.permits = threading.Semaphore(1)  # the prompt's step, then the engine waits
        stream = engine.generate(request("r", max_tokens=5, prompt_len=9))
        await anext(stream)
        assert (await engine.stats()).num_used_blocks == 3  # 9 + 1 tokens in blocks of 4
        worker.permits.release(1000)
        await stream.aclose()
        await engine.shutdown()

    asyncio.run(main())


def test_a_priority_under_the_fcfs_policy_is_refused():
    async def main():
        engine = await make_engine(ScriptedWorker())
        prioritized = EngineCoreRequest("p", [1, 2, 3], SamplingParams(max_tokens=2), eos_token_ids=(2,), priority=3)
        with pytest.raises(ValueError, match="scheduling policy"):
            await anext(engine.generate(prioritized))
        await engine.shutdown()

    asyncio.run(main())


class CheckedWorker(ScriptedWorker):
    """Counts its liveness checks (which, on a real worker, also renew the engine's lease on it)."""

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    def check_alive(self) -> None:
        self.checks += 1


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_the_idle_loop_checks_its_worker_however_often_it_is_woken():
    """Aborts of unknown requests wake the idle loop every 25 ms, four times an interval: the checks
    still come about once an interval (a worker whose lease lapsed would serve another engine)."""
    async def main():
        worker = CheckedWorker()
        engine = await AsyncEngine.create(worker, SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8),
                                          idle_check_interval=0.1)
        await until(lambda: worker.checks > 0)
        start = worker.checks
        for _ in range(40):
            await engine.abort(["nobody"])
            await asyncio.sleep(0.025)
        assert worker.checks - start >= 3
        await engine.shutdown()

    asyncio.run(main())
