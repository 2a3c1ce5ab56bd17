"""vllm:request_success, counted by the processor as vLLM's frontend counts it: each engine request
once, by the finish reason the client sees. The real AsyncProcessor over the real AsyncEngine,
whose stand-in worker samples TOKEN ("()") every step (tests/unit/test_client_contract.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from services.common.clients import GenerateRequest
from services.common.errors import EngineDeadError
from services.common.metrics import ServiceMetrics
from services.common.model_runner_output import ModelRunnerOutput, TokenLogprobs
from services.common.scheduler_output import SchedulerOutput
from services.processor.async_processor import AsyncProcessor
from services.processor.metrics import FINISH_REASONS, ProcessorMetrics
from services.processor.processor import Processor
from tests.unit.test_client_contract import INFO, TOKEN, FakeCore, drain, engine_client, first, generate_request

pytestmark = pytest.mark.anyio

MODEL = "m"


class Counted:
    """An AsyncProcessor with its metrics, and the request_success counts they hold."""

    def __init__(self, processor: AsyncProcessor, service: ServiceMetrics) -> None:
        self.processor = processor
        self.service = service

    def success(self) -> dict[str, float]:
        return {s.labels["finished_reason"]: s.value for family in self.service.registry.collect()
                for s in family.samples
                if s.name == "vllm:request_success_total" and s.labels["model_name"] == MODEL}


@asynccontextmanager
async def counted(tokenizer, model_path: Path, core: FakeCore | None = None) -> AsyncIterator[Counted]:
    service = ServiceMetrics.create("processor")
    metrics = ProcessorMetrics.for_models(service, {MODEL: INFO.max_model_len})[MODEL]
    async with engine_client("in-process", core or FakeCore()) as engine:
        processor = AsyncProcessor(Processor.for_tokenizer(tokenizer, model_path, INFO.max_model_len), engine,
                                   metrics)
        try:
            yield Counted(processor, service)
        finally:
            processor.close()


def counts(**reasons: float) -> dict[str, float]:
    return {reason: reasons.get(reason, 0.0) for reason in FINISH_REASONS}


def with_params(request: GenerateRequest, **params: object) -> GenerateRequest:
    return replace(request, params=replace(request.params, **params))


async def test_every_reason_is_exported_at_zero_and_a_choice_counts_its_finish_reason(tokenizer, model_path: Path):
    async with counted(tokenizer, model_path) as stack:
        assert stack.success() == counts()
        deltas = await drain(stack.processor.generate(with_params(generate_request("a", max_tokens=3), n=2)))
        assert sorted(c.finish_reason for d in deltas for c in d.choices if c.finish_reason) == ["length"] * 2
        assert stack.success() == counts(length=2)


@pytest.mark.parametrize("max_tokens", [1, None])
async def test_a_stop_string_counts_as_stop_whatever_the_engine_said(tokenizer, model_path: Path,
                                                                      max_tokens: int | None):
    """max_tokens 1: the engine finished the request by length in the very output the processor
    finds the stop string in. None: the engine runs on until the processor's abort reaches it."""
    async with counted(tokenizer, model_path) as stack:
        request = with_params(generate_request("a", max_tokens=max_tokens), stop=(")",))
        deltas = await drain(stack.processor.generate(request))
        assert [c.finish_reason for d in deltas for c in d.choices if c.finish_reason] == ["stop"]
        assert stack.success() == counts(stop=1)


async def test_choices_running_when_the_caller_goes_away_count_as_abort(tokenizer, model_path: Path):
    async with counted(tokenizer, model_path, FakeCore(step_delay=0.01)) as stack:
        request = with_params(generate_request("a", max_tokens=None), n=2)
        async with aclosing(stack.processor.generate(request)) as stream:
            await first(stream)
        assert stack.success() == counts(abort=2)


async def test_choices_an_engine_failure_ends_count_as_error(tokenizer, model_path: Path):
    core = FakeCore(step_delay=0.01)
    async with counted(tokenizer, model_path, core) as stack:
        stream = stack.processor.generate(generate_request("a", max_tokens=None))
        await first(stream)
        core.fail_with = RuntimeError("the worker failed")
        with pytest.raises(EngineDeadError):
            await drain(stream)
        assert stack.success() == counts(error=1)


class LogprobsCore(FakeCore):
    """Every request samples TOKEN and reports it with four alternatives after it (beam search
    asks for 2 x width logprobs)."""

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        output = super().execute_model(out)
        output.logprobs = [TokenLogprobs([TOKEN, TOKEN, TOKEN + 1, TOKEN + 3, TOKEN + 4],
                                         [-0.1, -0.1, -0.5, -1.0, -2.0], 1) for _ in output.req_ids]
        return output


async def test_beam_search_counts_each_step_request_as_vllms_beam_search_does(tokenizer, model_path: Path):
    """Width 2, two tokens: one request for the first step, one per live beam for the second."""
    async with counted(tokenizer, model_path, LogprobsCore()) as stack:
        request = replace(with_params(generate_request("a", max_tokens=2), n=2), use_beam_search=True)
        [delta] = await drain(stack.processor.generate(request))
        assert len(delta.choices) == 2
        assert stack.success() == counts(length=1 + 2)
