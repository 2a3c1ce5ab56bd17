"""Speculative decoding (n-gram) with the real model: the tokens a user gets are those without it
(greedy and seeded sampling alike), drafts are really accepted, and no KV block leaks or is cached
with a rejected draft's KV."""

from __future__ import annotations

import gc
import json
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import pytest

from services import LLM, SamplingParams
from services.common.config import SchedulerConfig
from services.common.model_files import DEFAULT_MODEL
from services.engine.engine_core import EngineCore
from services.processor.tokenizer import load_tokenizer
from services.worker.client import GrpcWorkerClient
from tests.model.test_tp_hf_equivalence import FanOutExecutor, generate, start_group
from services.common.structured_outputs import StructuredOutputs
from services.engine.speculator import SpecDecodingStats

KV_BYTES = 64 * 2**20
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}

TP_SCHEDULER = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4, max_num_waiting=None)

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, "
           "and wrote the weather in a leather book that had belonged to his grandfather.")
CODE = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n"
# Copy-heavy prompts (the output repeats the prompt: drafts are accepted) and one that is not.
PROMPTS = [
    f"Copy the text exactly.\nText: {PASSAGE}\nCopy: {PASSAGE[:40]}",
    f"Rename width to w in this code:\n{CODE}\nResult:\ndef area(w, height):\n",
    "Write one sentence about the moon.",
]


def make_llm(**kwargs) -> LLM:
    return LLM(model="smollm2", dtype="float32", quantization="gguf", kv_cache_memory=KV_BYTES, max_model_len=1024,
               **kwargs)


@pytest.fixture(scope="module")
def plain():
    llm = make_llm()
    yield llm
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def spec():
    # A small token budget: prompts are read in chunks while other requests verify their drafts.
    llm = make_llm(speculative_config=SPEC, max_num_batched_tokens=32)
    yield llm
    del llm
    gc.collect()


def stats(llm: LLM) -> SpecDecodingStats:
    s = llm.engine.scheduler.speculator.stats
    return SpecDecodingStats(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens,
                             list(s.num_accepted_tokens_per_pos))


def assert_nothing_left(llm: LLM) -> None:
    llm.flush()
    manager = llm.engine.kv_cache_manager
    llm.engine.check_integrity()
    pool = manager.block_pool
    assert pool.get_num_free_blocks() == len(pool.blocks)
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert not manager.req_to_blocks and not manager.num_cached_blocks
    assert llm.worker.runner.batch.num_reqs == 0


def run(llm: LLM, prompts, params: SamplingParams):
    return [o.outputs[0] for o in llm.generate(prompts, params)]


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_greedy_tokens_are_identical_and_drafts_are_accepted(plain: LLM, spec: LLM):
    params = SamplingParams(temperature=0, max_tokens=40)
    before = stats(spec)
    expected, got = run(plain, PROMPTS, params), run(spec, PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    after = stats(spec)
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    assert accepted >= 20, (drafted, accepted)  # the copies are largely drafted and accepted
    assert drafted > accepted, "no draft was ever rejected: the test does not cover rollback"
    assert sum(after.num_accepted_tokens_per_pos) == after.num_accepted_tokens
    assert_nothing_left(plain)
    assert_nothing_left(spec)


def test_one_request_alone_takes_fewer_steps(spec: LLM):
    """Each accepted draft is a token without a step of its own."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    engine = spec.engine
    steps = 0
    original = engine.step

    def counting_step():
        nonlocal steps
        steps += 1
        return original()

    engine.step = counting_step
    try:
        [out] = run(spec, PROMPTS[:1], params)
    finally:
        del engine.step
    assert len(out.token_ids) == 32
    assert steps <= 32 // 2, f"{steps} steps for 32 tokens"
    assert_nothing_left(spec)


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_seeded_sampling_draws_the_same_tokens(plain: LLM, spec: LLM):
    """A seeded draw depends on its seed and position only: verifying drafts draws at the same positions
    from the same distributions, so the tokens are those drawn one step at a time."""
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=7 + i, max_tokens=32) for i in range(len(PROMPTS))]
    expected, got = run(plain, PROMPTS, params), run(spec, PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert_nothing_left(spec)


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_penalties_and_logprobs_see_the_accepted_drafts(plain: LLM, spec: LLM):
    """Each drafted position is sampled as if the drafts before it were outputs already: penalties
    count them, and every new token (accepted drafts too) has its logprobs."""
    params = SamplingParams(temperature=0, max_tokens=24, frequency_penalty=0.3, logprobs=2)
    expected, got = run(plain, PROMPTS[:2], params), run(spec, PROMPTS[:2], params)
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids
        assert len(g.logprobs) == len(g.token_ids)
        for le, lg in zip(e.logprobs, g.logprobs):
            assert set(lg) == set(le)
            for token_id in le:
                assert lg[token_id].logprob == pytest.approx(le[token_id].logprob, abs=1e-3)
    assert_nothing_left(spec)


@pytest.mark.slow  # over a second: `make test`, not test-fast
@pytest.mark.parametrize("stop", ["max_tokens", "stop_token"])
def test_a_stop_inside_the_accepted_drafts_ends_there(plain: LLM, spec: LLM, stop: str):
    greedy = SamplingParams(temperature=0, max_tokens=40)
    [full] = run(plain, PROMPTS[:1], greedy)
    # A token deep in the copied text, first seen after several drafted steps.
    cut = 17
    if stop == "max_tokens":
        params = SamplingParams(temperature=0, max_tokens=cut)
    else:
        params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[full.token_ids[cut - 1]])
    [expected], [got] = run(plain, PROMPTS[:1], params), run(spec, PROMPTS[:1], params)
    assert got.token_ids == expected.token_ids
    assert got.finish_reason == expected.finish_reason
    assert len(got.token_ids) <= cut
    assert_nothing_left(spec)


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_prefix_cache_hits_on_blocks_computed_with_drafts(plain: LLM, spec: LLM):
    """A request's blocks are cached only once their tokens are known: a later prompt that continues
    an earlier output hits blocks whose KV was computed by draft verification, and still gets the
    tokens computed from scratch."""
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    tokenizer = spec.get_tokenizer()
    prompt_ids = tokenizer.encode(PROMPTS[0])
    [first] = run(spec, [prompt_ids], greedy)
    follow_up = prompt_ids + first.token_ids
    [expected] = run(plain, [follow_up], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    [got] = spec.generate([follow_up], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert got.num_cached_tokens >= len(follow_up) - 16 - 1  # the output's blocks were hits too
    assert got.outputs[0].token_ids == expected.token_ids
    assert_nothing_left(spec)


RECORD = {"name": "Ada Lovelace", "born": 1815, "field": "mathematics", "city": "London"}
RECORD_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"},
                                                  "field": {"type": "string"}, "city": {"type": "string"}},
                 "required": ["name", "born", "field", "city"], "additionalProperties": False}
STAIRS = "The lighthouse keeper climbed the spiral stairs"
COPY = f"Copy the text exactly.\nText: {PASSAGE}\nCopy: "
CONSTRAINED = [  # copy-heavy prompts, each under a grammar the copy fits
    (COPY, StructuredOutputs("regex", "The lighthouse keeper[a-z ,]*\\.")),
    (f"Copy the JSON exactly.\nJSON: {json.dumps(RECORD, separators=(',', ':'))}\nCopy: ",
     StructuredOutputs("json", json.dumps(RECORD_SCHEMA))),
    (PROMPTS[0], StructuredOutputs("choice", json.dumps([STAIRS, "A lamp"]))),
]


def recording_drafts(llm: LLM) -> dict[StructuredOutputs | None, list[int]]:
    """Every token drafted from now on, by the drafting request's constraint (None: unconstrained)."""
    drafts: dict[StructuredOutputs | None, list[int]] = {}
    scheduler = llm.engine.scheduler
    original = type(scheduler).schedule

    def schedule():
        output = original(scheduler)
        for request_id, tokens in output.scheduled_spec_decode_tokens.items():
            constraint = scheduler.requests[request_id].sampling_params.structured_outputs
            drafts.setdefault(constraint, []).extend(tokens)
        return output

    scheduler.schedule = schedule
    return drafts


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_structured_outputs_speculate_and_keep_their_tokens(plain: LLM, spec: LLM):
    """Each verified position samples under the grammar's state after the drafts before it: greedy
    outputs are those without speculation, and the copies are drafted and accepted."""
    prompts = [p for p, _ in CONSTRAINED]
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=c) for _, c in CONSTRAINED]
    before = stats(spec)
    expected, got = run(plain, prompts, params), run(spec, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected] == ["stop"] * 3
    assert json.loads(got[1].text) == RECORD
    assert got[2].text == STAIRS
    assert stats(spec).num_accepted_tokens - before.num_accepted_tokens >= 20
    assert_nothing_left(plain)
    assert_nothing_left(spec)


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_seeded_sampling_under_a_grammar_draws_the_same_tokens(plain: LLM, spec: LLM):
    prompts = [p for p, _ in CONSTRAINED]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=11 + i, max_tokens=60, structured_outputs=c)
              for i, (_, c) in enumerate(CONSTRAINED)]
    before = stats(spec)
    expected, got = run(plain, prompts, params), run(spec, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert stats(spec).num_accepted_tokens > before.num_accepted_tokens
    assert_nothing_left(spec)


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_drafts_stop_before_a_token_the_grammar_forbids_or_that_completes_it(plain: LLM, spec: LLM):
    """The prompt's copy drafts " spiral stairs every ...": under "... the long stairs" the grammar
    forbids " spiral"; under "... the spiral stairs" the draft " stairs" completes the grammar, and
    the draw after it would be past the grammar's end. Neither is verified: the constrained requests
    draft other tokens, their unconstrained batch-mate drafts these, and every output and finish is
    the one without speculation."""
    tokenizer = spec.get_tokenizer()
    [spiral], [stairs] = tokenizer.encode(" spiral"), tokenizer.encode(" stairs")
    forbids = StructuredOutputs("regex", "The lighthouse keeper climbed the long stairs")
    completes = StructuredOutputs("regex", STAIRS)
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=c) for c in (forbids, completes, None)]
    prompts = [COPY] * 3
    drafts = recording_drafts(spec)
    try:
        expected = run(plain, prompts, params)
        got = run(spec, prompts, params)
    finally:
        del spec.engine.scheduler.schedule
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected] == ["stop", "stop", "length"]
    assert [o.text for o in got[:2]] == ["The lighthouse keeper climbed the long stairs", STAIRS]
    assert drafts[forbids] and drafts[completes], "the constrained requests drafted"
    assert spiral in drafts[None] and stairs in drafts[None]
    assert spiral not in drafts[forbids] and stairs not in drafts[completes]
    assert_nothing_left(spec)


@pytest.mark.slow
def test_tensor_parallel_ranks_verify_the_same_drafts(model_path: Path):
    """At TP=2 the driver broadcasts every draw and each rank verifies the drafts itself: the ranks'
    batches stay alike (the next steps' all-reduces would mix different tokens otherwise), and the
    tokens are those of the same group without speculation."""
    tokenizer = load_tokenizer(model_path)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:2]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
    with ExitStack() as exits:
        ranks = start_group(DEFAULT_MODEL, 2, KV_BYTES // 4, timeout=30.0)
        for rank in ranks:
            exits.callback(rank.kill)
        executor = FanOutExecutor([GrpcWorkerClient(r.address) for r in ranks])
        exits.callback(executor.close)
        plain_engine = executor.engine(TP_SCHEDULER)
        expected = generate(plain_engine, prompts, params)
        plain_engine.step()  # the workers drop the finished requests
        spec_engine = EngineCore(executor, plain_engine.worker_info, plain_engine.kv_cache_manager.block_pool.num_blocks,
                                 replace(TP_SCHEDULER, speculative_config=SPEC))
        got = generate(spec_engine, prompts, params)
        assert spec_engine.scheduler.speculator.stats.num_accepted_tokens > 10
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
