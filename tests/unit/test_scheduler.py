"""The scheduler on its own: exact token budgets, block ids, preemption and aborts after scripted
calls, and random traffic holding the invariants. Model outputs are made up here: the scheduler
only needs a token per request that completed its scheduled tokens."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.config import SpeculativeConfig
from services.common.model_runner_output import ModelRunnerOutput
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import SchedulerOutput
from services.engine.kv_cache_manager import KVCacheManager
from services.engine.request import Request, RequestStatus
from services.engine.scheduler import Scheduler
from services.engine.speculator import Speculator

BLOCK = 4
EOS = 2


def make_scheduler(num_blocks=64, budget=32, max_seqs=8, max_model_len=256, policy="fcfs",
                   caching=True) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BLOCK, caching), budget, max_seqs, max_model_len, policy)


def make_request(rid: str, num_prompt: int, max_tokens: int = 8, first_token: int = 100, priority: int = 0,
                 **params) -> Request:
    prompt = list(range(first_token, first_token + num_prompt))
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), max_tokens,
                   eos_token_ids=[EOS], block_size=BLOCK, priority=priority)


def fake_output(out: SchedulerOutput, sched: Scheduler, token: int = 7) -> ModelRunnerOutput:
    """A token for every request whose scheduled tokens reach its last known token."""
    done = [rid for rid in out.num_scheduled_tokens
            if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens]
    return ModelRunnerOutput(done, [token] * len(done))


def step(sched: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list]:
    out = sched.schedule()
    results = sched.update_from_output(out, fake_output(out, sched, token))
    sched.check_integrity()
    return out, results


def test_budget_is_spent_running_first_then_waiting_with_chunked_prefill():
    sched = make_scheduler(budget=32)
    for rid, n, first in (("a", 10, 100), ("b", 20, 200), ("c", 30, 300)):
        sched.add_request(make_request(rid, n, first_token=first))
    out, results = step(sched)
    assert out.num_scheduled_tokens == {"a": 10, "b": 20, "c": 2}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a", "b", "c"]
    assert [r.request_id for r in results] == ["a", "b"]  # c is mid-prefill: no token yet
    assert sched.requests["c"].num_computed_tokens == 2
    out, _ = step(sched)
    # Running requests first: a and b decode one token each, c gets the rest of the budget.
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 28}
    assert [r.req_id for r in out.scheduled_cached_reqs] == ["a", "b", "c"]
    assert out.scheduled_new_reqs == []


def test_block_ids_are_exact_and_grow_by_diff():
    sched = make_scheduler(budget=64, caching=False)
    sched.add_request(make_request("a", 6))
    sched.add_request(make_request("b", 3))
    out, _ = step(sched)
    assert [r.block_ids for r in out.scheduled_new_reqs] == [[0, 1], [2]]
    # a: 7 tokens, 8th needs no new block; b: 4 tokens computed... b's 4th token fits block 2.
    out, _ = step(sched)
    assert {c.req_id: c.new_block_ids for c in out.scheduled_cached_reqs} == {"a": [], "b": []}
    out, _ = step(sched)  # a computes token 8 → still block 1; b computes token 5 → new block
    assert {c.req_id: c.new_block_ids for c in out.scheduled_cached_reqs} == {"a": [], "b": [3]}


def test_max_num_seqs_caps_the_running_batch():
    sched = make_scheduler(max_seqs=2, budget=100)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 5))
    out, _ = step(sched)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert sched.num_waiting == 2


def test_preemption_by_recompute_takes_the_last_running_request():
    # 6 blocks of 4 tokens; three requests of 7 tokens take 2 blocks each, then need a third.
    sched = make_scheduler(num_blocks=6, budget=64, caching=False)
    for rid in "abc":
        sched.add_request(make_request(rid, 7, max_tokens=6))
    step(sched)  # 7 prompt tokens each, all blocks used
    out, _ = step(sched)  # token 8 fits; a, b, c have 8 tokens now
    assert sched.kv_cache_manager.num_free_blocks == 0
    out, _ = step(sched)  # a needs a third block: c (the last) is preempted, then b can't either
    assert out.num_preempted >= 1
    c = sched.requests["c"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert "c" in out.finished_req_ids  # the worker must drop its state
    assert "c" not in out.num_scheduled_tokens
    assert out.scheduled_new_reqs == []  # nothing admitted in a step that preempted
    assert next(iter(sched.waiting)) is c  # back at the front
    assert sched.num_preemptions == out.num_preempted
    # Everything still finishes, and the preempted request resumes with its tokens so far.
    resumed = None
    for _ in range(100):
        out, _ = step(sched)
        for new in out.scheduled_new_reqs:
            if new.req_id == "c":
                resumed = new
        if not sched.has_unfinished_requests():
            break
    assert resumed is not None and resumed.output_token_ids == [7, 7]
    assert sched.kv_cache_manager.num_free_blocks == 6


def test_priority_policy_admits_and_preempts_by_priority():
    sched = make_scheduler(num_blocks=4, budget=64, policy="priority", caching=False)
    sched.add_request(make_request("low", 7, priority=5))
    sched.add_request(make_request("high", 7, priority=0))
    out, _ = step(sched)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["high", "low"]
    step(sched)
    out, _ = step(sched)  # both need a third block; the low-priority one goes
    assert sched.requests["low"].status == RequestStatus.PREEMPTED
    assert sched.requests["high"].status == RequestStatus.RUNNING


def test_abort_is_idempotent_and_frees_everything():
    sched = make_scheduler(budget=16)
    sched.add_request(make_request("run", 8))
    sched.add_request(make_request("wait", 30, first_token=500))
    step(sched)
    assert sched.requests["wait"].num_computed_tokens == 8  # mid-prefill
    finished = sched.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in finished} == {"run", "wait"}
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in finished)
    assert sched.finish_requests(["run"], RequestStatus.FINISHED_ABORTED) == []
    sched.check_integrity()
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 64
    out = sched.schedule()
    assert out.finished_req_ids == {"run", "wait"} and out.is_empty
    assert sched.schedule().finished_req_ids == set()  # told once


def test_output_for_a_request_aborted_during_the_step_is_dropped():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    out = sched.schedule()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, ModelRunnerOutput(["a"], [7])) == []
    sched.check_integrity()


def test_stop_conditions():
    sched = make_scheduler(budget=64)
    sched.add_request(make_request("eos", 4))
    sched.add_request(make_request("ignore", 4, ignore_eos=True, max_tokens=2))
    sched.add_request(make_request("stop_id", 4, stop_token_ids=[EOS]))
    sched.add_request(make_request("min", 4, min_tokens=2))
    _, results = step(sched, token=EOS)
    by_id = {r.request_id: r for r in results}
    assert by_id["eos"].finish_reason == "stop" and by_id["eos"].stop_reason is None
    assert by_id["stop_id"].finish_reason == "stop"
    assert not by_id["ignore"].finished and not by_id["min"].finished
    _, results = step(sched, token=EOS)
    by_id = {r.request_id: r for r in results}
    assert by_id["ignore"].finish_reason == "length"
    assert by_id["min"].finish_reason == "stop"
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 64


def test_prefix_hit_counts_and_never_the_whole_prompt():
    sched = make_scheduler(budget=64)
    sched.add_request(make_request("a", 12, max_tokens=1))
    step(sched)
    sched.add_request(make_request("b", 12, max_tokens=1))
    out, _ = step(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8  # 2 of 3 full blocks: the last is computed
    assert out.num_scheduled_tokens == {"b": 4}
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 64


@pytest.mark.slow  # over a second: `make test`, not test-fast
@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["fcfs", "priority"]), st.booleans())
def test_random_traffic_keeps_invariants(seed: int, policy: str, caching: bool):
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=24, budget=rng.choice([8, 16, 48]), max_seqs=rng.choice([2, 4, 8]),
                           max_model_len=96, policy=policy, caching=caching)
    next_id = 0
    for _ in range(120):
        if rng.random() < 0.4:
            n = rng.randint(1, 40)
            sched.add_request(make_request(f"r{next_id}", n, max_tokens=rng.randint(1, 20),
                                           first_token=rng.choice([100, 100, 500]), priority=rng.randint(0, 3)))
            next_id += 1
        if sched.requests and rng.random() < 0.1:
            sched.finish_requests([rng.choice(list(sched.requests))], RequestStatus.FINISHED_ABORTED)
        step(sched, token=rng.choice([7, 8, 9, EOS]))
        pool = sched.kv_cache_manager.block_pool
        used = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert used + pool.get_num_free_blocks() == 24
    sched.finish_requests(list(sched.requests), RequestStatus.FINISHED_ABORTED)
    sched.check_integrity()
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 24


def make_speculating_scheduler(num_blocks=64) -> Scheduler:
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=2))
    return Scheduler(KVCacheManager(num_blocks, BLOCK, True), 32, 8, 256, speculator=speculator)


def decoding_request(sched: Scheduler, **params) -> Request:
    """A request past its prefill whose tokens 5 6 7 8 5 6 | 7 repeat: it drafts 8 5 6 next (the 2-gram
    "6 7" occurred at positions 1-2)."""
    request = Request("r", [5, 6, 7, 8, 5, 6], SamplingParams(**params), params["max_tokens"],
                      eos_token_ids=[EOS], block_size=BLOCK)
    sched.add_request(request)
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {}  # a prompt drafts nothing
    sched.update_from_output(out, ModelRunnerOutput(["r"], [7]))
    return request


def test_drafts_are_scheduled_and_the_rejected_ones_taken_back():
    sched = make_speculating_scheduler()
    request = decoding_request(sched, max_tokens=10)
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {"r": [8, 5, 6]}
    assert out.num_scheduled_tokens == {"r": 4} and out.total_num_scheduled_tokens == 4
    assert request.num_computed_tokens == 10  # through the drafts, until the worker says
    assert sched.kv_cache_manager.get_block_ids("r") == [0, 1, 2]
    [result] = sched.update_from_output(out, ModelRunnerOutput(["r"], [9], num_accepted_drafts=[1]))
    assert result.new_token_ids == [8, 9]
    assert request.all_token_ids == [5, 6, 7, 8, 5, 6, 7, 8, 9]
    assert request.num_computed_tokens == 8  # the rejected drafts' KV is recomputed
    sched.check_integrity()
    # Only the block of known tokens is cached; block 2 (positions 8-11) holds a rejected draft's KV.
    assert sched.kv_cache_manager.num_cached_blocks["r"] == 1
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {}  # "8 9" never occurred before
    assert out.num_scheduled_tokens == {"r": 1}
    sched.update_from_output(out, fake_output(out, sched))
    sched.check_integrity()


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there():
    sched = make_speculating_scheduler()
    decoding_request(sched, max_tokens=10, stop_token_ids=[5])
    out = sched.schedule()
    [result] = sched.update_from_output(out, ModelRunnerOutput(["r"], [4], num_accepted_drafts=[3]))
    assert result.new_token_ids == [8, 5]  # the accepted 6 and the sampled 4 come after the stop
    assert result.finish_reason == "stop" and result.stop_reason == 5
    assert not sched.requests and sched.kv_cache_manager.num_free_blocks == 64
    sched.check_integrity()


def test_drafts_stop_short_of_max_tokens():
    sched = make_speculating_scheduler()
    decoding_request(sched, max_tokens=3)
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {"r": [8]}  # one output so far, one draft, one sampled
    [result] = sched.update_from_output(out, ModelRunnerOutput(["r"], [4], num_accepted_drafts=[1]))
    assert result.new_token_ids == [8, 4] and result.finish_reason == "length"
    sched.check_integrity()
