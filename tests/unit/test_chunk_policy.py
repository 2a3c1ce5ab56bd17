"""Prefill chunks sized from measured step times (services/engine/chunk_policy.py), and what the
scheduler makes of them: a long prompt is read in short chunks while running requests decode in
every step; a request the worker refused ends with finish_reason "error" and frees its blocks."""

from __future__ import annotations

from services.common.model_runner_output import ModelRunnerOutput
from services.engine.chunk_policy import INITIAL_CHUNK, MIN_MEASURED_TOKENS, AdaptiveChunking
from services.engine.kv_cache_manager import KVCacheManager
from services.engine.scheduler import Scheduler
from tests.unit.test_scheduler import BLOCK, fake_output, make_request


def test_chunks_follow_the_measured_speed_within_the_budget():
    chunking = AdaptiveChunking(max_tokens=2048, target_seconds=0.5)
    assert chunking.max_prefill_tokens() == INITIAL_CHUNK  # nothing measured yet
    chunking.record_step(256, 1.0)  # 256 tokens/s: 128 tokens in 0.5 s
    assert chunking.max_prefill_tokens() == 128
    chunking.record_step(1, 5.0)  # a decode step measures the step's fixed cost: ignored
    assert chunking.max_prefill_tokens() == 128
    chunking.record_step(128, 1.0)  # slower at longer context; the average follows
    assert chunking.max_prefill_tokens() == int(0.5 / (0.5 / 128 + 0.5 / 256))
    for _ in range(20):
        chunking.record_step(2048, 0.01)  # a GPU: the full budget
    assert chunking.max_prefill_tokens() == 2048
    for _ in range(20):
        chunking.record_step(MIN_MEASURED_TOKENS, 100.0)  # never below the floor
    assert chunking.max_prefill_tokens() == MIN_MEASURED_TOKENS


def test_no_target_means_full_chunks():
    chunking = AdaptiveChunking(max_tokens=2048, target_seconds=0.0)
    chunking.record_step(256, 10.0)
    assert chunking.max_prefill_tokens() == 2048


def test_a_long_prompt_is_read_in_chunks_while_a_running_request_decodes_every_step():
    chunking = AdaptiveChunking(max_tokens=512, target_seconds=1.0)
    sched = Scheduler(KVCacheManager(256, BLOCK, True), 512, 8, 1024, chunking=chunking)
    sched.add_request(make_request("chat", 8, max_tokens=100))
    out = sched.schedule()
    sched.update_from_output(out, fake_output(out, sched))
    chunking.record_step(100, 1.0)  # 100 tokens a second
    sched.add_request(make_request("long", 600, max_tokens=4, first_token=1000))
    for _ in range(6):
        out = sched.schedule()
        assert out.num_scheduled_tokens == {"chat": 1, "long": 100}
        sched.update_from_output(out, fake_output(out, sched))
        sched.check_integrity()
    assert sched.requests["long"].num_computed_tokens == 600


def test_a_request_the_worker_refused_ends_alone_with_error():
    sched = Scheduler(KVCacheManager(64, BLOCK, True), 64, 8, 256)
    sched.add_request(make_request("good", 5))
    sched.add_request(make_request("bad", 5, first_token=300))
    out = sched.schedule()
    outputs = sched.update_from_output(out, ModelRunnerOutput(["good"], [7], failed={"bad": "bad: NaN"}))
    assert [(o.request_id, o.finish_reason, o.error) for o in outputs] == [("good", None, None),
                                                                         ("bad", "error", "bad: NaN")]
    assert "bad" not in sched.requests and [r.request_id for r in sched.running] == ["good"]
    sched.check_integrity()
    assert "bad" in sched.schedule().finished_req_ids  # the worker is told to drop it (it already did)


def test_prompts_arriving_together_are_read_one_after_another_and_the_first_answers_first():
    # Four 300-token prompts and a step that reads 100 prompt tokens: the cap is the step's, so the
    # first prompt is read in three steps and samples its first token then (with a cap per request,
    # all four would be read side by side and answer only after twelve steps' worth of work).
    chunking = AdaptiveChunking(max_tokens=1024, target_seconds=1.0)
    chunking.record_step(100, 1.0)
    sched = Scheduler(KVCacheManager(1024, BLOCK, True), 1024, 8, 1024, chunking=chunking)
    for name in "abcd":
        sched.add_request(make_request(name, 300, max_tokens=4, first_token=ord(name) * 1000))
    first_token_step = {}
    for step_number in range(1, 30):
        out = sched.schedule()
        prefill = {r: n for r, n in out.num_scheduled_tokens.items() if n > 1}
        assert sum(prefill.values()) <= 100, out.num_scheduled_tokens
        assert len(prefill) <= 2, out.num_scheduled_tokens  # at most the one finishing and the next
        for output in sched.update_from_output(out, fake_output(out, sched)):
            first_token_step.setdefault(output.request_id, step_number)
        sched.check_integrity()
        if not sched.has_unfinished_requests():
            break
    assert first_token_step == {"a": 3, "b": 6, "c": 9, "d": 12}
    assert not sched.has_unfinished_requests()


def test_decodes_are_never_cut_by_the_prefill_cap():
    chunking = AdaptiveChunking(max_tokens=512, target_seconds=1.0)
    chunking.record_step(40, 1.0)  # 40 prompt tokens a step
    sched = Scheduler(KVCacheManager(512, BLOCK, True), 512, 64, 1024, chunking=chunking)
    for i in range(50):
        sched.add_request(make_request(f"chat{i}", 4, max_tokens=100))
    while len(sched.running) < 50:  # 10 prompts of 4 tokens a step
        out = sched.schedule()
        sched.update_from_output(out, fake_output(out, sched))
    sched.add_request(make_request("long", 200, max_tokens=4, first_token=1000))
    out = sched.schedule()
    assert sum(1 for n in out.num_scheduled_tokens.values() if n == 1) == 50  # every stream decodes
    assert out.num_scheduled_tokens["long"] == 40
