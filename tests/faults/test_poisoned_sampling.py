"""A sampler that raises for one request's parameters fails that request alone: the worker samples
the step's rows one by one, reports the culprit (ModelRunnerOutput.failed), the engine ends its
stream with ValueError, and its batch-mates get the tokens they get without it. No parameter makes
today's sampler raise (the worker refuses non-finite numbers before sampling:
tests/faults/test_supervision.py), so the fault is injected: a sampler that raises whenever a row
uses min-p."""

from __future__ import annotations

import asyncio

from services.common.config import EngineArgs
from services.common.engine_output import EngineCoreRequest
from services.common.sampling_params import SamplingParams
from services.inprocess import AsyncStack
from services.worker.sampler import Sampler

GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
POISONED = SamplingParams(temperature=1.0, min_p=0.5, max_tokens=8)


class MinPRaises(Sampler):
    def forward(self, logits, meta):
        if meta.min_p is not None:
            raise RuntimeError("injected: this sampler cannot do min-p")
        return super().forward(logits, meta)


async def run(stack: AsyncStack, request: EngineCoreRequest) -> tuple[list[int], list[int]] | BaseException:
    """The request's token ids and logprob ranks, or the exception its stream ended with."""
    tokens, ranks = [], []
    try:
        async for output in stack.engine.generate(request):
            tokens += output.new_token_ids
            ranks += [lp.rank for lp in output.new_logprobs]
    except ValueError as exc:
        return exc
    return tokens, ranks


def test_a_request_that_breaks_the_sampler_fails_alone(served_model: str):
    async def main():
        stack = await AsyncStack.create(EngineArgs.from_kwargs(model=served_model, dtype="float32", kv_cache_memory=64 * 2**20))
        try:
            prompts = [[1, 504, 3575, 282, 4649, 314], [33, 28, 216, 34, 28, 216, 35]]
            good = [EngineCoreRequest(f"alone-{i}", p, GREEDY) for i, p in enumerate(prompts)]
            alone = [await run(stack, r) for r in good]
            stack.worker.runner.sampler = MinPRaises()
            mixed = [EngineCoreRequest("good-0", prompts[0], GREEDY), EngineCoreRequest("bad", [5, 6, 7], POISONED),
                     EngineCoreRequest("good-1", prompts[1], GREEDY)]
            results = await asyncio.gather(*(run(stack, r) for r in mixed))
            after = await run(stack, EngineCoreRequest("after", prompts[0], GREEDY))
            stack.engine.core.check_integrity()
            return alone, results, after, await stack.engine.is_healthy()
        finally:
            await stack.shutdown()

    alone, (first, bad, second), after, healthy = asyncio.run(main())
    assert isinstance(bad, ValueError) and "sampling failed" in str(bad), bad
    assert [first, second] == alone
    assert after == alone[0]
    assert healthy
