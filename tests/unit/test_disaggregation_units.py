"""Disaggregated prefill/decode's cores, pinned to exact state: the decode side's
transfer blocks (allocated uncached, cached on commit, freed on cancel), the prefill side's lease
(held on free, released or expired), the scheduler's admission of a prefilled request, the
processor's decision, and `kvmesh serve`'s P/D layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from services import cli
from services.common.config import DisaggregationConfig, ServeConfig
from services.common.engine_output import EngineCoreRequest
from services.common.sampling_params import SamplingParams
from services.common.structured_outputs import StructuredOutputs
from services.common.flags import build
from services.common.kv_events import BlockStored
from services.engine.kv_cache_manager import KVCacheManager, TransferBlocks
from services.engine.kv_event_queue import KVEventQueue
from services.engine.request import RequestStatus
from services.engine.scheduler import Scheduler
from services.processor.prefill_decider import PrefillDecider, outcome_of
from tests.unit.test_kv_cache_manager import B, admit, free_ids, make_request, ref_cnts, take


# ----------------------------------------------------------------------------- decode side: transfer blocks

def test_transfer_blocks_are_uncached_until_commit_then_hit_at_admission():
    manager = KVCacheManager(10, B, kv_events=KVEventQueue())
    request = make_request("a", list(range(14)))  # 3 full blocks + 2 tokens
    transfer = manager.allocate_transfer(request)
    assert transfer == TransferBlocks(0, [0, 1, 2])  # the full blocks only: the tail is computed here
    assert ref_cnts(manager)[:4] == [1, 1, 1, 0]
    assert manager.num_matched_blocks(request.block_hashes) == 0  # nobody can hit them yet
    manager.check_integrity()
    assert take(manager) == []

    manager.commit_transfer(request, transfer)
    manager.check_integrity()
    assert ref_cnts(manager)[:3] == [0, 0, 0]  # freed into the prefix cache, last block evicted first
    assert free_ids(manager) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    h = request.block_hashes
    assert take(manager) == [BlockStored(h[:3], None, list(range(12)), B)]

    request.append_output_token_ids([99])  # P's first token
    hits, num_hit_tokens, new_blocks = admit(manager, request)
    assert ([b.block_id for b in hits], num_hit_tokens) == ([0, 1, 2], 12)
    assert [b.block_id for b in new_blocks] == [3]  # 2 prompt tokens + the first token


def test_a_transfer_skips_the_blocks_cached_here_and_cancel_frees_uncached():
    manager = KVCacheManager(10, B)
    first = make_request("first", list(range(8)) + [7])
    admit(manager, first)  # caches blocks 0, 1
    manager.free(first)
    request = make_request("b", list(range(8)) + list(range(100, 109)))  # 4 full blocks, 2 cached
    transfer = manager.allocate_transfer(request)
    assert transfer.first_block == 2 and len(transfer.block_ids) == 2
    assert manager.cancel_transfer("b") and not manager.cancel_transfer("b")  # idempotent
    manager.check_integrity()
    assert manager.num_matched_blocks(request.block_hashes) == 2  # nothing of b was cached
    assert manager.num_free_blocks == 10


def test_nothing_to_transfer_no_blocks_or_no_caching_means_compute_here():
    assert KVCacheManager(10, B).allocate_transfer(make_request("short", [1, 2, 3])) is None
    assert KVCacheManager(2, B).allocate_transfer(make_request("big", list(range(13)))) is None
    assert KVCacheManager(10, B, enable_caching=False).allocate_transfer(make_request("x", list(range(9)))) is None


# ----------------------------------------------------------------------------- prefill side: leases

def test_a_held_request_keeps_its_blocks_under_a_lease_until_release():
    manager = KVCacheManager(10, B)
    request = make_request("p", list(range(9)))
    manager.hold_on_free("p", 30.0)
    admit(manager, request)
    manager.free(request)  # finished on P: its KV is on its way to D
    assert manager.leased_block_ids("p") == [0, 1, 2]
    assert manager.num_free_blocks == 7
    manager.check_integrity()
    assert manager.release_lease("p") and not manager.release_lease("p")
    assert manager.num_free_blocks == 10 and manager.leases == {}
    manager.check_integrity()


def test_leases_expire_at_their_deadline():
    manager = KVCacheManager(10, B)
    for request_id, seconds in (("a", 1.0), ("b", 100.0)):
        request = make_request(request_id, list(range(5)))
        manager.hold_on_free(request_id, seconds)
        admit(manager, request)
        manager.free(request)
    expiry_a = manager.leases["a"].expires_at
    assert manager.next_lease_expiry() == expiry_a
    assert manager.expire_leases(expiry_a - 0.001) == []
    assert manager.expire_leases(expiry_a) == ["a"]
    assert list(manager.leases) == ["b"] and manager.num_free_blocks == 8
    manager.check_integrity()


# ----------------------------------------------------------------------------- scheduler

def test_a_prefilled_request_starts_with_its_first_token_or_ends_with_it():
    scheduler = Scheduler(KVCacheManager(10, B), max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    request = make_request("a", list(range(6)))
    output = scheduler.add_prefilled_request(request, 42)
    assert (output.new_token_ids, output.finish_reason) == ([42], None)
    assert request.output_token_ids == [42] and scheduler.num_waiting == 1
    out = scheduler.schedule()
    assert out.scheduled_new_reqs[0].output_token_ids == [42]  # the worker resumes from it
    assert out.num_scheduled_tokens == {"a": 7}

    done = make_request("b", list(range(6)), eos_token_ids=(7,))
    output = scheduler.add_prefilled_request(done, 7)
    assert (output.new_token_ids, output.finish_reason) == ([7], "stop")
    assert done.status == RequestStatus.FINISHED_STOPPED and "b" not in scheduler.requests
    scheduler.check_integrity()


# ----------------------------------------------------------------------------- the processor's decider

@pytest.mark.parametrize(("num_tokens", "cached", "outcome"), [
    (100, 0, "short"), (1, 0, "short"),  # at most the threshold, whatever is cached
    (260, 160, "cached"),  # 100 left to compute on the decode engine
    (261, 160, "remote"), (1000, 0, "remote"),
])
def test_the_decider_sends_only_long_uncached_prompts_to_a_prefill_engine(num_tokens, cached, outcome):
    assert outcome_of(num_tokens, cached, threshold=100) == outcome


@pytest.mark.anyio
async def test_the_decider_keeps_adapter_and_constrained_requests_on_the_decode_engine():
    # Neither consults the decode engine: it is never reached here.
    decider = PrefillDecider(decode=None, prefill_addresses=["unix:/prefill.sock"], threshold=4)
    long_prompt = list(range(50))
    adapter = EngineCoreRequest("a", long_prompt, SamplingParams(max_tokens=2), lora_name="sql")
    constrained = EngineCoreRequest("c", long_prompt, SamplingParams(
        max_tokens=2, structured_outputs=StructuredOutputs("choice", '["x", "y"]')))
    for request, outcome in ((adapter, "adapter"), (constrained, "constrained")):
        decided = await decider.decide(request)
        assert decided.prefill_engine_address is None and decider.outcomes[outcome] == 1


# ----------------------------------------------------------------------------- kvmesh serve

def test_serve_lays_out_prefill_and_decode_groups_and_their_flags():
    parser = cli.build_serve_parser()
    args = parser.parse_args(["--prefill-engines", "1", "--decode-engines", "2", "--prefill-threshold", "64"])
    spec = cli.serve_spec(parser, args)
    groups = cli.groups_for(spec.serve)
    assert [(g.workers, g.engine, g.role) for g in groups] == [
        (("worker-prefill-0",), "engine-prefill-0", "prefill"), (("worker-decode-0",), "engine-decode-0", "decode"),
        (("worker-decode-1",), "engine-decode-1", "decode")]
    names = cli.internal_names(groups)
    sockets = Path("/run/user/1000/kvmesh-serve-test")
    layout = cli.Layout(groups, sockets, dict(zip(names, range(11, 18))))
    argvs = cli.service_argvs(spec, layout)
    assert "--kv-transfer-address" in argvs["worker-decode-1"]
    assert argvs["engine-prefill-0"][argvs["engine-prefill-0"].index("--engine-role") + 1] == "prefill"
    processor = argvs["processor"]
    assert [processor[i + 1] for i, a in enumerate(processor) if a == "--engine-address"] == \
        [f"unix:{sockets}/engine-decode-{i}.sock" for i in (0, 1)]  # the decode engines only
    assert [processor[i + 1] for i, a in enumerate(processor) if a == "--prefill-engine-address"] == \
        [f"unix:{sockets}/engine-prefill-0.sock"]
    assert processor[processor.index("--prefill-threshold") + 1] == "64"
    with pytest.raises(ValueError, match="go together"):
        ServeConfig(prefill_engines=1)
    with pytest.raises(ValueError, match="exclude each other"):
        ServeConfig(prefill_engines=1, decode_engines=1, num_engines=2)
    with pytest.raises(ValueError, match="engine_role"):
        DisaggregationConfig(engine_role="middle")
