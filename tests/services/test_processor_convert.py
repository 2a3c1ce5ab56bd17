"""gateway <-> processor wire conversions: every value the cores produce survives the round trip."""

from __future__ import annotations

import pytest

from services.common.clients import ChoiceDelta, GenerateDelta, GenerateRequest
from services.common.model_runner_output import TokenLogprobs
from services.common.rpc.kvmesh.v1 import processor_pb2
from services.common.sampling_params import SamplingParams
from services.common.rpc.convert import (
    generate_delta_from_proto,
    generate_delta_to_proto,
    generate_request_from_proto,
    generate_request_to_proto,
)

PARAMS = SamplingParams(n=2, temperature=0.5, seed=3, stop=("a", "bc"), logit_bias={5: -1.5}, max_tokens=None,
                        logprobs=2, stop_token_ids=(7,))


@pytest.mark.parametrize("request_", [
    GenerateRequest("r1", PARAMS, prompt="Hello"),
    GenerateRequest("r2", SamplingParams(), prompt_token_ids=[1, 2, 3], add_special_tokens=False, priority=-2),
    GenerateRequest("r3", PARAMS, messages=[{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Hi", "name": "ann"}],
                    add_generation_prompt=False, continue_final_message=True,
                    chat_template_kwargs={"enable_thinking": False, "tools": [{"name": "f"}]}, cache_salt="salt"),
])
def test_generate_request_round_trip(request_: GenerateRequest):
    assert generate_request_from_proto(generate_request_to_proto(request_)) == request_


@pytest.mark.parametrize("delta", [
    GenerateDelta([ChoiceDelta(0, "Hi", [5])], prompt_token_ids=[1, 2], num_prompt_tokens=2, num_cached_tokens=1,
                  num_generated_tokens=1),
    GenerateDelta([ChoiceDelta(1, "", [9, 2], [TokenLogprobs([9, 4], [-0.5, -2.0], 1),
                                               TokenLogprobs([2, 2], [-0.25, -0.25], 1)],
                               "stop", "bc", [["x", "y"], ["</s>", "</s>"]]),
                   ChoiceDelta(0, " end", [3], finish_reason="stop", stop_reason=7)],
                  num_prompt_tokens=2, num_generated_tokens=6),
    GenerateDelta([ChoiceDelta(0, "", [], finish_reason="length")], num_prompt_tokens=4, num_generated_tokens=16),
])
def test_generate_delta_round_trip(delta: GenerateDelta):
    assert generate_delta_from_proto(generate_delta_to_proto(delta)) == delta


def test_a_request_without_prompt_is_refused():
    message = generate_request_to_proto(GenerateRequest("r", SamplingParams(), prompt="x"))
    message.ClearField("text")
    with pytest.raises(ValueError, match="no prompt"):
        generate_request_from_proto(message)
    with pytest.raises(ValueError, match="request_id"):
        generate_request_from_proto(processor_pb2.GenerateRequest())
