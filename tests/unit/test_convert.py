"""Proto <-> core conversions: every core value survives the wire unchanged."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest

from services.common.clients import EngineInfo, EngineStats, LoRAState, WorkerInfo
from services.common.engine_output import EngineCoreOutput, EngineCoreRequest
from services.common.model_runner_output import ModelRunnerOutput, TokenLogprobs
from services.common.rpc import convert
from services.common.rpc.kvmesh.v1 import common_pb2, engine_pb2, worker_pb2
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import CachedRequestData, GrammarBitmask, NewRequestData, SchedulerOutput
from services.common.structured_outputs import StructuredOutputs

PARAMS = [
    SamplingParams(),
    SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=2**40 + 7, presence_penalty=-1.5,
                   frequency_penalty=0.3, repetition_penalty=1.1, logit_bias={5: -100.0, 7: 2.5}, max_tokens=None,
                   min_tokens=4, stop=("\n\n", "END"), stop_token_ids=(2, 9), include_stop_str_in_output=True,
                   ignore_eos=True, logprobs=5, prompt_logprobs=0, skip_special_tokens=False,
                   spaces_between_special_tokens=False, num_resumed_outputs=3, allowed_token_ids=(4, 2, 9)),
    SamplingParams(logprob_token_ids=(7, 3, 7), allowed_token_ids=(1,)),
    SamplingParams(temperature=0.0, seed=0, logprobs=0, max_tokens=1),
    SamplingParams(structured_outputs=StructuredOutputs("json", '{"type": "object"}')),
    SamplingParams(structured_outputs=StructuredOutputs("json_object")),
]
LOGPROBS = TokenLogprobs([11, 3, 11], [-0.25, -1.5, -3.0], 1)


@pytest.mark.parametrize("params", PARAMS)
def test_sampling_params_round_trip(params: SamplingParams):
    back = convert.sampling_params_from_proto(convert.sampling_params_to_proto(params))
    assert back == params
    assert (back.seed, back.max_tokens, back.logprobs, back.prompt_logprobs) == (
        params.seed, params.max_tokens, params.logprobs, params.prompt_logprobs)


def test_sampling_params_empty_logit_bias():
    params = SamplingParams(logit_bias={})
    back = convert.sampling_params_from_proto(convert.sampling_params_to_proto(params))
    assert back.logit_bias is None  # an empty map is None


def test_invalid_sampling_params_from_the_wire_raise_value_error():
    msg = convert.sampling_params_to_proto(SamplingParams())
    msg.top_p = 1.5
    with pytest.raises(ValueError, match="top_p"):
        convert.sampling_params_from_proto(msg)
    with pytest.raises(ValueError, match="n must be"):
        convert.sampling_params_from_proto(common_pb2.SamplingParams())  # fields left unset


def test_token_logprobs_round_trip():
    assert convert.token_logprobs_from_proto(convert.token_logprobs_to_proto(LOGPROBS)) == LOGPROBS


def test_scheduler_output_round_trip():
    out = SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData("a", [1, 2, 3], [], PARAMS[1], frozenset({2, 9}), [4, 5], 16),
            NewRequestData("b", [7] * 40, [8, 9], PARAMS[0], frozenset(), [0, 1, 2], 0),
        ],
        scheduled_cached_reqs=[CachedRequestData("c", [], 33), CachedRequestData("d", [12], 47)],
        num_scheduled_tokens={"a": 3, "b": 42, "c": 1, "d": 1},
        total_num_scheduled_tokens=47,
        finished_req_ids={"x", "y"},
        num_preempted=1,
        grammar_bitmask=GrammarBitmask(["d", "a"], bytes(range(16))),
        removed_lora_ids=[2, 7],
        scheduled_spec_decode_tokens={"d": [4, 4, 9], "c": [1]},
    )
    assert convert.scheduler_output_from_proto(convert.scheduler_output_to_proto(out)) == out
    broken = convert.scheduler_output_to_proto(out)
    del broken.spec_token_ids[-1]
    with pytest.raises(ValueError, match="spec_token_ids"):
        convert.scheduler_output_from_proto(broken)
    empty = SchedulerOutput([], [], {}, 0)
    assert convert.scheduler_output_from_proto(convert.scheduler_output_to_proto(empty)) == empty


def test_model_runner_output_round_trip():
    outputs = [
        ModelRunnerOutput([], []),
        ModelRunnerOutput(["a", "b"], [5, 6]),
        ModelRunnerOutput(["a", "b"], [5, 6], logprobs=[LOGPROBS, TokenLogprobs([6], [-0.5], 1)],
                          prompt_logprobs={"a": [LOGPROBS, LOGPROBS], "c": []}),
        ModelRunnerOutput(["a", "b"], [5, 6], num_accepted_drafts=[0, 3]),
    ]
    for out in outputs:
        assert convert.model_runner_output_from_proto(convert.model_runner_output_to_proto(out)) == out


def test_engine_request_round_trip_and_validation():
    request = EngineCoreRequest("r1", [1, 2, 3], PARAMS[1], eos_token_ids=(2, 0), priority=-3, cache_salt="s",
                                tenant_id="0123456789abcdef")
    assert convert.engine_request_from_proto(convert.engine_request_to_proto(request)) == request
    plain = EngineCoreRequest("r2", [9], SamplingParams())
    assert convert.engine_request_from_proto(convert.engine_request_to_proto(plain)) == plain
    # The arrival time is the engine's own clock: it stays behind.
    stamped = EngineCoreRequest("r3", [9], SamplingParams(), arrival_time=12.5)
    assert convert.engine_request_from_proto(convert.engine_request_to_proto(stamped)).arrival_time is None
    with pytest.raises(ValueError, match="sampling_params"):
        convert.engine_request_from_proto(engine_pb2.EngineRequest(request_id="r", prompt_token_ids=[1]))
    with pytest.raises(ValueError, match="request_id"):
        convert.engine_request_from_proto(engine_pb2.EngineRequest())
    with pytest.raises(ValueError, match="tenant_id"):  # an engine keys its queue on it: short ones only
        convert.engine_request_from_proto(convert.engine_request_to_proto(dataclasses.replace(plain, tenant_id="t" * 65)))


@pytest.mark.parametrize("output", [
    EngineCoreOutput("r", [5]),
    EngineCoreOutput("r", [5], new_logprobs=[LOGPROBS], new_prompt_logprobs=[LOGPROBS, LOGPROBS], num_cached_tokens=32),
    EngineCoreOutput("r", [2], finish_reason="stop"),  # EOS: no stop reason
    EngineCoreOutput("r", [9], finish_reason="stop", stop_reason=9),
    EngineCoreOutput("r", [9], finish_reason="stop", stop_reason="END"),
    EngineCoreOutput("r", [0], finish_reason="stop", stop_reason=0),  # token id 0 is a reason, not None
    EngineCoreOutput("r", [], finish_reason="abort"),
])
def test_engine_output_round_trip(output: EngineCoreOutput):
    assert convert.engine_output_from_proto(convert.engine_output_to_proto(output)) == output


def test_stats_and_info_round_trip():
    stats = EngineStats(3, 4, 17, 1024, 2, 5000, 1234)
    assert convert.engine_stats_from_proto(convert.engine_stats_to_proto(stats)) == stats
    stats = EngineStats(3, 4, 17, 1024, 2, 5000, 1234, LoRAState(("a", "b", "c"), ("a",), ("b",), ("a", "c"), 2, 1))
    assert convert.engine_stats_from_proto(convert.engine_stats_to_proto(stats)) == stats
    assert convert.engine_stats_from_proto(convert.engine_stats_to_proto(replace(stats, lora=LoRAState()))).lora \
        == LoRAState()  # LoRA on, no adapter yet: not the same as off
    info = EngineInfo("smollm2", "/models/smollm2", 8192, 16, role="decode", kv_transfer_endpoints=("a:1/x", "b:2/y"))
    assert convert.engine_info_from_proto(convert.engine_info_to_proto(info)) == info
    worker = WorkerInfo("smollm2", "/models/smollm2", 49152, 8192, 16)
    assert convert.worker_info_from_proto(convert.worker_info_to_proto(worker)) == worker


@pytest.mark.parametrize("cls, message_type", [
    (WorkerInfo, worker_pb2.WorkerInfo), (EngineInfo, engine_pb2.EngineInfo), (LoRAState, engine_pb2.LoRAState),
])
def test_conversions_by_name_cover_every_field_of_both_sides(cls, message_type):
    """fields_to_proto / fields_from_proto match fields by name: the two sides must name the same ones."""
    assert [f.name for f in dataclasses.fields(cls)] == [f.name for f in message_type.DESCRIPTOR.fields]
    def sample(i: int, f: dataclasses.Field) -> object:
        return f"v{i}" if f.type == "str" else (f"v{i}",) if f.type.startswith("tuple[str") else i + 1
    value = cls(**{f.name: sample(i, f) for i, f in enumerate(dataclasses.fields(cls))})
    assert convert.fields_from_proto(convert.fields_to_proto(value, message_type), cls) == value
