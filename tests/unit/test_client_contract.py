"""One contract per client interface, run against both of its implementations: the in-process core
and the gRPC client of the real servicer over that same core (a grpc.aio server on 127.0.0.1, port
0). The same fault raises the same exception either way (services/common/errors.py).

No model: the worker core is a stand-in that samples TOKEN for every scheduled request, under the
real AsyncEngine; the processor uses the real tokenizer only.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, aclosing, asynccontextmanager
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from services.common.clients import (
    EngineClient,
    GenerateRequest,
    ProcessorClient,
    TokenizeRequest,
    WorkerClient,
    WorkerInfo,
)
from services.common.config import SchedulerConfig
from services.common.engine_output import EngineCoreRequest
from services.common.errors import (
    ERRORS,
    EngineDeadError,
    EngineOverloadedError,
    InternalError,
    exception_of,
    status_of,
)
from services.common.model_runner_output import ModelRunnerOutput
from services.common.rpc.kvmesh.v1 import engine_pb2_grpc, processor_pb2_grpc, worker_pb2_grpc
from services.common.rpc.server import RpcServer
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import NewRequestData, SchedulerOutput
from services.engine.async_engine import AsyncEngine
from services.engine.client import GrpcEngineClient
from services.engine.server import EngineServicer, follow_engine_health
from services.processor.async_processor import AsyncProcessor
from services.processor.client import GrpcProcessorClient
from services.processor.processor import Processor
from services.processor.server import ProcessorServicer, follow_engine_health as follow_processor_health
from services.worker.client import GrpcWorkerClient, InProcessWorkerClient
from services.worker.server import WorkerServicer
from tests.services.procs import free_port

pytestmark = pytest.mark.anyio

TOKEN = 1000  # an ordinary token of the tokenizer's vocabulary
INFO = WorkerInfo(model_id="fake", model_path="/nowhere", vocab_size=49152, max_model_len=256, block_size=4)
SECRET = "other-client-prompt"  # in an unexpected failure's message: must not reach the caller
KINDS = ["in-process", "grpc"]


class FakeCore:
    """Stands in for services.worker.worker.Worker: no model; every scheduled request samples TOKEN
    (the prompts here fit one step, so no row is a partial prefill). `step_delay` keeps a request
    running for a while; `fail_with` fails every later step."""

    info = INFO

    def __init__(self, step_delay: float = 0.0) -> None:
        self.step_delay = step_delay
        self.fail_with: Exception | None = None

    def determine_num_blocks(self) -> int:
        return 256

    def initialize_cache(self, num_blocks: int, max_num_reqs: int) -> None:
        pass

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self.fail_with is not None:
            raise self.fail_with
        time.sleep(self.step_delay)
        req_ids = list(out.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids, [TOKEN] * len(req_ids))


@asynccontextmanager
async def implementation(kind: str, core: object, add_servicer: Callable, servicer: Callable,
                         connect: Callable[[str], object], follow_health: Callable | None = None) -> AsyncIterator:
    """`core` itself (in-process), or a gRPC client (`connect(address)`) of `servicer(core)` on a real
    grpc.aio server on loopback, whose health follows `follow_health(core, server)` as in serve()."""
    if kind == "in-process":
        yield core
        return
    server = RpcServer("127.0.0.1", 0, [])
    service = servicer(core)
    add_servicer(service, server.server)
    await server.start()
    health = asyncio.create_task(follow_health(core, server)) if follow_health is not None else None
    client = connect(f"127.0.0.1:{server.port}")
    try:
        yield client
    finally:
        if health is not None:
            health.cancel()
        closed = client.close()
        if inspect.isawaitable(closed):  # the worker's client is blocking
            await closed
        await server.server.stop(0)
        if hasattr(service, "close"):  # the worker's: its step channel
            await service.close()


def unreachable() -> str:
    return f"127.0.0.1:{free_port()}"  # nothing listens there


# ----------------------------------------------------------------------------- the table


@pytest.mark.parametrize("cls, code", ERRORS)
def test_every_row_travels_both_ways(cls: type[Exception], code: grpc.StatusCode):
    status = status_of(cls("why"))
    assert status == (code, "why")
    back = exception_of(grpc.aio.AioRpcError(status.code, None, None, status.details))
    assert type(back) is cls and str(back) == "why"


def test_an_unexpected_error_is_internal_and_names_nothing_of_it():
    status = status_of(KeyError(SECRET))
    assert status.code == grpc.StatusCode.INTERNAL
    assert SECRET not in status.details and "KeyError" not in status.details
    assert isinstance(exception_of(grpc.aio.AioRpcError(grpc.StatusCode.UNIMPLEMENTED, None, None, "x")),
                      InternalError)


# ----------------------------------------------------------------------------- WorkerClient


def worker_client(kind: str, core: FakeCore) -> AbstractAsyncContextManager[WorkerClient]:
    return implementation(kind, InProcessWorkerClient(core, max_num_reqs=8),
                          worker_pb2_grpc.add_WorkerServicer_to_server, WorkerServicer,
                          lambda address: GrpcWorkerClient(address, timeout=5, liveness_timeout=5))


def one_step(req_id: str = "r") -> SchedulerOutput:
    new = NewRequestData(req_id=req_id, prompt_token_ids=[1, 2, 3], output_token_ids=[],
                         sampling_params=SamplingParams(temperature=0), stop_token_ids=frozenset(),
                         block_ids=[0], num_computed_tokens=0)
    return SchedulerOutput([new], [], {req_id: 3}, 3)


@pytest.mark.parametrize("kind", KINDS)
async def test_worker_answers_and_refuses_invalid_input(kind: str):
    # The blocking client runs on a thread: the server shares this event loop.
    async with worker_client(kind, FakeCore()) as worker:
        info = await asyncio.to_thread(worker.get_info)
        assert replace(info, step_port=0) == INFO
        assert (info.step_port > 0) == (kind == "grpc")  # the gRPC worker's step channel
        assert await asyncio.to_thread(worker.initialize_cache, 4) == 256
        for bad in (0, 9):
            with pytest.raises(ValueError, match="max_num_reqs"):
                await asyncio.to_thread(worker.initialize_cache, bad)
        assert await asyncio.to_thread(worker.execute_model, one_step()) == ModelRunnerOutput(["r"], [TOKEN])


@pytest.mark.parametrize("kind", KINDS)
async def test_a_failed_worker_step_raises_and_over_grpc_names_nothing_of_it(kind: str):
    core = FakeCore()
    core.fail_with = RuntimeError(SECRET)
    async with worker_client(kind, core) as worker:
        await asyncio.to_thread(worker.initialize_cache, 4)  # the step's engine owns the worker
        with pytest.raises(Exception) as failed:
            await asyncio.to_thread(worker.execute_model, one_step())
    if kind == "in-process":  # the core's own exception: the engine logs it, and says EngineDeadError
        assert failed.value is core.fail_with
    else:
        assert type(failed.value) is InternalError and SECRET not in str(failed.value)
        assert "RuntimeError" not in str(failed.value)


@pytest.mark.slow  # over a second: `make test`, not test-fast
async def test_an_unreachable_worker_is_connection_error_and_a_late_one_timeout():
    worker = GrpcWorkerClient(unreachable(), timeout=0.5, liveness_timeout=0.5)
    with pytest.raises(ConnectionError):
        await asyncio.to_thread(worker.execute_model, one_step())
    with pytest.raises(TimeoutError):  # set-up calls wait for the worker to come up, until their deadline
        await asyncio.to_thread(worker.get_info)
    worker.close()


# ----------------------------------------------------------------------------- EngineClient


@asynccontextmanager
async def engine_client(kind: str, core: FakeCore, max_num_seqs: int = 8,
                        max_num_waiting: int | None = None) -> AsyncIterator[EngineClient]:
    engine = await AsyncEngine.create(
        InProcessWorkerClient(core),
        SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=max_num_seqs, max_num_waiting=max_num_waiting))
    try:
        async with implementation(kind, engine, engine_pb2_grpc.add_EngineServicer_to_server, EngineServicer,
                                  lambda address: GrpcEngineClient(address, timeout=5, stream_timeout=30),
                                  follow_engine_health) as client:
            yield client
    finally:
        await engine.shutdown()


def engine_request(request_id: str, max_tokens: int | None = 4, prompt_len: int = 4,
                   priority: int = 0) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, list(range(10, 10 + prompt_len)),
                             SamplingParams(temperature=0, max_tokens=max_tokens), eos_token_ids=(2,),
                             priority=priority)


async def first(stream: AsyncIterator):
    async with asyncio.timeout(10):
        return await anext(stream)


async def drain(stream: AsyncIterator) -> list:
    async with asyncio.timeout(10), aclosing(stream):
        return [item async for item in stream]


@pytest.mark.parametrize("kind", KINDS)
async def test_engine_streams_tokens_and_reports(kind: str):
    async with engine_client(kind, FakeCore()) as engine:
        assert (await engine.info()).model_id == "fake"
        outputs = await drain(engine.generate(engine_request("a")))
        assert [t for o in outputs for t in o.new_token_ids] == [TOKEN] * 4
        assert outputs[-1].finish_reason == "length"
        stats = await engine.stats()
        assert (stats.num_running, stats.num_waiting, stats.num_total_blocks) == (0, 0, 256)
        await engine.abort(["a", "never-seen"])  # idempotent, unknown ids too
        assert await engine.is_healthy()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("request_, match", [
    (engine_request("long", prompt_len=INFO.max_model_len), "context"),
    (engine_request("empty", prompt_len=0), "empty"),
    (engine_request("urgent", priority=1), "priority"),
])
async def test_engine_refuses_invalid_input_with_value_error(kind: str, request_: EngineCoreRequest, match: str):
    async with engine_client(kind, FakeCore()) as engine:
        with pytest.raises(ValueError, match=match):
            await drain(engine.generate(request_))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("limits, second_id, error, match", [
    ({}, "a", ValueError, "already in use"),  # the running request's id
    ({"max_num_seqs": 1, "max_num_waiting": 0}, "b", EngineOverloadedError, "full"),  # no room to queue it
])
async def test_while_one_request_runs_a_second_is_refused(kind: str, limits: dict, second_id: str,
                                                          error: type[Exception], match: str):
    async with engine_client(kind, FakeCore(step_delay=0.01), **limits) as engine:
        async with aclosing(engine.generate(engine_request("a", max_tokens=None))) as running:
            await first(running)
            with pytest.raises(error, match=match):
                await drain(engine.generate(engine_request(second_id)))


async def test_an_unreachable_engine_is_connection_error():
    engine = GrpcEngineClient(unreachable(), timeout=2)
    with pytest.raises(ConnectionError):
        await engine.info()
    with pytest.raises(ConnectionError):
        await drain(engine.generate(engine_request("a")))
    with pytest.raises(ConnectionError):
        await engine.stats()
    assert not await engine.is_healthy()
    await engine.close()


# ----------------------------------------------------------------------------- ProcessorClient


def processor_client(kind: str, engine: EngineClient, tokenizer,
                     model_path: Path) -> AbstractAsyncContextManager[ProcessorClient]:
    processor = AsyncProcessor(Processor.for_tokenizer(tokenizer, model_path, INFO.max_model_len), engine)
    return implementation(kind, processor, processor_pb2_grpc.add_ProcessorServicer_to_server, ProcessorServicer,
                          lambda address: GrpcProcessorClient(address, timeout=5, stream_timeout=30),
                          lambda core, server: follow_processor_health(core, server, 0.01))


def generate_request(request_id: str, max_tokens: int | None = 3, **prompt) -> GenerateRequest:
    return GenerateRequest(request_id, SamplingParams(temperature=0, max_tokens=max_tokens),
                           **(prompt or {"prompt": "Hello there"}))


@asynccontextmanager
async def stack(kind: str, tokenizer, model_path: Path, core: FakeCore | None = None,
                **limits) -> AsyncIterator[ProcessorClient]:
    """A processor of `kind` over an in-process engine (the processor's own engine client is
    in-process either way: its gRPC one has a contract of its own above)."""
    async with engine_client("in-process", core or FakeCore(), **limits) as engine:
        async with processor_client(kind, engine, tokenizer, model_path) as processor:
            yield processor


@pytest.mark.parametrize("kind", KINDS)
async def test_processor_generates_tokenizes_and_reports(kind: str, tokenizer, model_path: Path):
    async with stack(kind, tokenizer, model_path) as processor:
        deltas = await drain(processor.generate(generate_request("a")))
        assert [t for d in deltas for c in d.choices for t in c.token_ids] == [TOKEN] * 3
        assert "".join(c.text for d in deltas for c in d.choices) == tokenizer.decode([TOKEN] * 3)
        tokenized = await processor.tokenize(TokenizeRequest(prompt="Hello there"))
        assert tokenized.token_ids == tokenizer.encode("Hello there") and tokenized.max_model_len == INFO.max_model_len
        assert await processor.detokenize(tokenized.token_ids) == "Hello there"
        assert (await processor.model_info()).model_id == "fake"


@pytest.mark.parametrize("kind", KINDS)
async def test_processor_refuses_invalid_input_with_value_error(kind: str, tokenizer, model_path: Path):
    async with stack(kind, tokenizer, model_path) as processor:
        with pytest.raises(ValueError, match="empty"):
            await drain(processor.generate(generate_request("a", prompt="")))
        with pytest.raises(ValueError, match="vocabulary"):
            await drain(processor.generate(generate_request("b", prompt_token_ids=[10**6])))
        with pytest.raises(ValueError, match="context"):
            await drain(processor.generate(generate_request("c", prompt_token_ids=[TOKEN] * INFO.max_model_len)))
        with pytest.raises(ValueError):
            await processor.tokenize(TokenizeRequest())
        with pytest.raises(ValueError, match="vocabulary"):
            await processor.detokenize([10**6])
        with pytest.raises(ValueError, match="context length"):
            await processor.detokenize([TOKEN] * (INFO.max_model_len + 1))


@pytest.mark.parametrize("kind", KINDS)
async def test_processor_passes_engine_overloaded_error_on(kind: str, tokenizer, model_path: Path):
    async with stack(kind, tokenizer, model_path, FakeCore(step_delay=0.01), max_num_seqs=1,
                     max_num_waiting=0) as processor:
        async with aclosing(processor.generate(generate_request("a", max_tokens=None))) as running:
            await first(running)
            with pytest.raises(EngineOverloadedError):
                await drain(processor.generate(generate_request("b")))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layer", ["engine", "processor"])
async def test_a_failed_step_is_engine_dead_error_for_open_and_later_requests(kind: str, layer: str, tokenizer,
                                                                              model_path: Path):
    core = FakeCore(step_delay=0.01)
    if layer == "engine":
        implementation_, make_request = engine_client(kind, core), engine_request
    else:  # the processor passes it on
        implementation_, make_request = stack(kind, tokenizer, model_path, core), generate_request
    async with implementation_ as client:
        running = client.generate(make_request("a", max_tokens=None))
        await first(running)
        core.fail_with = RuntimeError(SECRET)
        with pytest.raises(EngineDeadError) as dead:
            await drain(running)
        assert SECRET not in str(dead.value)
        with pytest.raises(EngineDeadError):
            await drain(client.generate(make_request("b")))
        async with asyncio.timeout(5):
            while await client.is_healthy():  # a server's health follows its core's, soon after
                await asyncio.sleep(0.01)


@pytest.mark.parametrize("kind", KINDS)
async def test_an_unreachable_engine_behind_the_processor_is_connection_error(kind: str, tokenizer,
                                                                               model_path: Path):
    engine = GrpcEngineClient(unreachable(), timeout=2)
    async with processor_client(kind, engine, tokenizer, model_path) as processor:
        with pytest.raises(ConnectionError):
            await drain(processor.generate(generate_request("a")))
        with pytest.raises(ConnectionError):
            await processor.model_info()
    await engine.close()


async def test_an_unreachable_processor_is_connection_error():
    processor = GrpcProcessorClient(unreachable(), timeout=2)
    with pytest.raises(ConnectionError):
        await drain(processor.generate(generate_request("a")))
    with pytest.raises(ConnectionError):
        await processor.tokenize(TokenizeRequest(prompt="Hi"))
    assert not await processor.is_healthy()
    await processor.close()
