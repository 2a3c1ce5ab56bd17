"""The gateway's request models on their own: vLLM's type coercion, the stream_options rule, the
fields refused as unimplemented (and that docs/serving/vllm_api.md lists every field)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.sampling import to_sampling_params
from services.gateway.unsupported import UNSUPPORTED, UNSUPPORTED_CHAT, unsupported_asks

CHAT = [{"role": "user", "content": "hi"}]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving" / "vllm_api.md"


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": CHAT, **fields})


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "x", **fields})


def test_compatible_types_are_coerced_as_pydantic_does_by_default():
    body = chat(logprobs="true", top_logprobs="3", max_tokens="5", temperature="0.5", n=2.0, stream=1,
                stream_options={"include_usage": "false"}, stop_token_ids=["7"], logit_bias={"5": "-1"})
    assert (body.logprobs, body.top_logprobs, body.max_tokens, body.temperature, body.n, body.stream) == \
        (True, 3, 5, 0.5, 2, True)
    assert body.stop_token_ids == [7] and body.logit_bias == {"5": -1.0} and not body.include_usage
    for bad in ({"max_tokens": 1.5}, {"n": "two"}, {"logprobs": "maybe"}, {"temperature": float("nan")}):
        with pytest.raises(ValidationError):
            chat(**bad)


def test_continuous_usage_only_with_usage_as_in_vllm():
    def options(**stream_options) -> tuple[bool, bool]:
        body = completion(stream=True, stream_options=stream_options)
        return body.include_usage, body.continuous_usage_stats

    assert options(include_usage=False, continuous_usage_stats=True) == (False, False)
    assert options(continuous_usage_stats=True) == (False, False)  # include_usage defaults to false, as in vLLM
    assert options() == (False, False)
    assert options(include_usage=True) == (True, False)
    assert options(include_usage=True, continuous_usage_stats=True) == (True, True)
    assert completion(stream=True).include_usage is False  # no stream_options: OpenAI's default, no usage


def test_logit_bias_names_every_key_that_is_not_a_token_id():
    with pytest.raises(ValueError, match=r"'a', 'b'$"):
        to_sampling_params(completion(logit_bias={"a": 1, "3": 2, "b": 1}))


def test_explicit_logprob_ids_take_the_top_n_place():
    params = to_sampling_params(completion(logprobs=2, logprob_token_ids=[4, 5]))
    assert params.logprobs is None and params.logprob_token_ids == (4, 5) and params.num_logprobs == 2
    params = to_sampling_params(chat(logprobs=True, logprob_token_ids=[9], allowed_token_ids=[1, 2]))
    assert params.num_logprobs == 1 and params.allowed_token_ids == (1, 2)
    with pytest.raises(ValidationError, match="logprobs is true"):
        chat(logprob_token_ids=[1])
    with pytest.raises(ValidationError, match="logprobs is set"):
        completion(logprob_token_ids=[1])
    with pytest.raises(ValidationError, match="echo and max_tokens 0"):
        completion(logprobs=1, logprob_token_ids=[1], echo=True, max_tokens=0)
    with pytest.raises(ValidationError, match="allowed_token_ids must not be an empty list"):
        completion(allowed_token_ids=[])


def test_defaults_ask_for_nothing_and_every_refused_field_is_named():
    assert unsupported_asks(chat()) == [] and unsupported_asks(completion()) == []
    assert unsupported_asks(chat(tools=[{"type": "function"}], tool_choice="none")) == []
    asked = unsupported_asks(completion(use_beam_search=True, length_penalty=0.5, stream_interval=2, best_of=3,
                                        truncation_side="right", prompt_embeds=["AAAA"], suffix="!"))
    assert [a.field for a in asked] == ["best_of", "stream_interval", "prompt_embeds", "suffix"]
    assert unsupported_asks(completion(add_special_tokens=True)) == []  # completions implement it
    assert [a.field for a in unsupported_asks(chat(add_special_tokens=True))] == ["add_special_tokens"]
    assert [a.field for a in unsupported_asks(chat(tools=[{"type": "function"}]))] == ["tools"]
    assert [a.field for a in unsupported_asks(chat(tool_choice="auto"))] == ["tool_choice"]
    assert [a.field for a in unsupported_asks(chat(tools=[]))] == ["tools"]
    for name in UNSUPPORTED:
        assert name in ChatCompletionRequest.model_fields or name in CompletionRequest.model_fields, name


def test_an_empty_prompt_is_refused_in_vllms_words_unless_embeddings_stand_in():
    for body in ({"prompt": ""}, {"prompt": []}, {"prompt": None}, {}, {"prompt_embeds": []}):
        with pytest.raises(ValidationError, match="Either prompt or prompt_embeds must be provided and non-empty"):
            CompletionRequest.model_validate(body)
    # Embeddings in its place: the 400 refusing them, which says more.
    body = CompletionRequest.model_validate({"prompt_embeds": "AAAA"})
    assert [a.field for a in unsupported_asks(body)] == ["prompt_embeds"]


def test_the_docs_table_lists_every_request_field():
    """docs/serving/vllm_api.md's table has a row for each field of both request models (and of the refused ones)."""
    rows = set(re.findall(r"^\| `(\w+)` \|", DOCS.read_text(), flags=re.MULTILINE))
    fields = {*ChatCompletionRequest.model_fields, *CompletionRequest.model_fields, *UNSUPPORTED, *UNSUPPORTED_CHAT}
    assert fields - rows == set()
