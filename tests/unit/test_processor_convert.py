"""gateway <-> processor wire conversions: every value the cores produce survives the round trip."""

from __future__ import annotations

import json

import pytest

from services.common.clients import ChoiceDelta, GenerateDelta, GenerateRequest, Tokenized, TokenizeRequest
from services.common.model_runner_output import TokenLogprobs
from services.common.rpc.convert import (
    generate_delta_from_proto,
    generate_delta_to_proto,
    generate_request_from_proto,
    generate_request_to_proto,
    sampling_params_to_proto,
    tokenize_request_from_proto,
    tokenize_request_to_proto,
    tokenized_from_proto,
    tokenized_to_proto,
)
from services.common.rpc.kvmesh.v1 import processor_pb2
from services.common.sampling_params import SamplingParams

PARAMS = SamplingParams(n=2, temperature=0.5, seed=3, stop=("a", "bc"), logit_bias={5: -1.5}, max_tokens=None,
                        logprobs=2, stop_token_ids=(7,))


@pytest.mark.parametrize("request_", [
    GenerateRequest("r1", PARAMS, prompt="Hello"),
    GenerateRequest("r2", SamplingParams(), prompt_token_ids=[1, 2, 3], add_special_tokens=False, priority=-2),
    GenerateRequest("r3", PARAMS, messages=[{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Hi", "name": "ann"}],
                    add_generation_prompt=False, continue_final_message=True,
                    chat_template_kwargs={"enable_thinking": False, "tools": [{"name": "f"}]}, cache_salt="salt"),
    GenerateRequest("r4", SamplingParams(prompt_logprobs=3), prompt="Hi", truncate_prompt_tokens=5, echo=True,
                    truncate_right=True),
    GenerateRequest("r5", SamplingParams(), prompt="Hi", group_id="g", session_id="s", tenant_id="0123456789abcdef"),
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
    GenerateDelta([ChoiceDelta(0, "x", [4])], prompt_token_ids=[1, 2, 3], num_prompt_tokens=3, prompt_text="a b",
                  prompt_logprobs=[None, TokenLogprobs([2, 7], [-1.0, -0.5], 2), TokenLogprobs([3, 3], [-0.125, -0.125], 1)],
                  prompt_logprob_tokens=[["a"], [" b", "c"], ["", ""]]),
    GenerateDelta([ChoiceDelta(0, "x", [4])], prompt_token_ids=[1], num_prompt_tokens=1,
                  prompt_logprobs=[None], prompt_logprob_tokens=[["a"]]),
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


@pytest.mark.parametrize("request_", [
    TokenizeRequest(prompt="Hello", return_token_strs=True),
    TokenizeRequest(messages=[{"role": "user", "content": "Hi"}], add_special_tokens=False,
                    add_generation_prompt=False, continue_final_message=True, chat_template_kwargs={"x": [1, "y"]}),
])
def test_tokenize_request_round_trip(request_: TokenizeRequest):
    assert tokenize_request_from_proto(tokenize_request_to_proto(request_)) == request_


@pytest.mark.parametrize("tokenized", [Tokenized([1, 2], 256), Tokenized([5], 8, ["Ġa"]), Tokenized([], 8, [])])
def test_tokenized_round_trip(tokenized: Tokenized):
    assert tokenized_from_proto(tokenized_to_proto(tokenized)) == tokenized


def test_a_tokenize_request_without_prompt_is_refused():
    with pytest.raises(ValueError, match="no prompt"):
        tokenize_request_from_proto(processor_pb2.TokenizeRequest())


def test_chat_json_reaches_the_processor_as_the_client_wrote_it():
    """Numbers keep their form across the wire: a tool's "minimum": 1 must reach the chat template
    as 1, not 1.0 (a protobuf Struct would make every number a double), and integers past 2**53
    stay exact."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 2**53 + 1}},
        "required": ["n"]}}}]
    messages = [{"role": "user", "content": "Grüße, 1.0 and 2"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"n": 3, "x": 0.5}}}]}]
    request = GenerateRequest("r", SamplingParams(), messages=messages, chat_template_kwargs={"tools": tools})
    back = generate_request_from_proto(generate_request_to_proto(request))
    assert json.dumps(back.messages) == json.dumps(messages)
    assert json.dumps(back.chat_template_kwargs) == json.dumps({"tools": tools})
    tokenize = TokenizeRequest(messages=messages, chat_template_kwargs={"tools": tools})
    assert json.dumps(tokenize_request_from_proto(tokenize_request_to_proto(tokenize)).chat_template_kwargs) == \
        json.dumps({"tools": tools})


def _deep(levels: int) -> dict:
    value: dict = {"leaf": 1}
    for _ in range(levels):
        value = {"a": value}
    return value


@pytest.mark.parametrize(("messages_json", "kwargs_json", "error"), [
    ("[{\"role\": \"user\"", "", "messages is not JSON"),
    ("{\"role\": \"user\"}", "", "messages is not a JSON array"),
    ("[\"hi\"]", "", r"messages\[0\] is not a JSON object"),
    (json.dumps([{"role": "user", "x": _deep(40)}]), "", r"messages\[0\] is nested more than 32"),
    ("[" * 100_000 + "]" * 100_000, "", "messages is not JSON"),
    ("[]", "[1]", "chat_template_kwargs is not a JSON object"),
    ("[]", json.dumps({"x": _deep(40)}), "chat_template_kwargs is nested more than 32"),
    ("[]", "{\"x\": 1" + "0" * 400 + "}", "chat_template_kwargs holds a number beyond the range of a double"),
])
def test_chat_json_from_any_caller_is_checked(messages_json: str, kwargs_json: str, error: str):
    """The processor takes the JSON text from whoever calls it: malformed, mistyped, too deep or too
    large, it is a ValueError (the server's INVALID_ARGUMENT), never a crash."""
    message = processor_pb2.GenerateRequest(request_id="r", params=sampling_params_to_proto(SamplingParams()),
                                            chat=processor_pb2.ChatMessages(json=messages_json),
                                            chat_template_kwargs_json=kwargs_json)
    with pytest.raises(ValueError, match=error):
        generate_request_from_proto(message)
