"""vLLM's extensions of the OpenAI API (token ids in and out, stream_options, type coercion,
the fields kvmesh refuses), through `kvmesh serve` with the official `openai` client (vLLM's fields in
`extra_body`) or raw HTTP where the client cannot say it. Field names and shapes are vLLM's
(vllm/entrypoints/openai/{completion,chat_completion}/protocol.py); docs/serving/vllm_api.md lists them all.

On the session's shared stack (`serve`, tests/conftest.py); small max_tokens throughout.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.services.test_openai_api import CHAT, PROMPT, client, http, model  # noqa: F401 (the same fixtures)

GREEDY = {"temperature": 0, "max_tokens": 6}
IDS = {"return_token_ids": True}


def tokens(http, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


def text_of(http, token_ids: list[int]) -> str:
    return http.post("/detokenize", json={"tokens": token_ids}).json()["prompt"]


def error_of(response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


# ----------------------------------------------------------------------------- item 1: token ids


def test_completion_returns_prompt_and_output_token_ids(client, model, http):
    whole = client.completions.create(model=model, prompt=[PROMPT, "1, 2, 3,"], n=2, **GREEDY, extra_body=IDS)
    raw = whole.model_dump()
    for choice in raw["choices"]:
        prompt = PROMPT if choice["index"] < 2 else "1, 2, 3,"
        assert choice["prompt_token_ids"] == tokens(http, prompt)
        assert len(choice["token_ids"]) == 6 and text_of(http, choice["token_ids"]) == choice["text"]
    # Streamed: the prompt's ids in each choice's first chunk only, then each chunk's new ids.
    chunks = [c.model_dump() for c in client.completions.create(model=model, prompt=PROMPT, stream=True,
                                                                **GREEDY, extra_body=IDS)]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == tokens(http, PROMPT)
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == raw["choices"][0]["token_ids"]
    # Not asked for: not there.
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=1).model_dump()["choices"][0]
    assert plain["prompt_token_ids"] is None and plain["token_ids"] is None


def test_chat_returns_prompt_and_output_token_ids(client, model, http):
    prompt = http.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    whole = client.chat.completions.create(model=model, messages=CHAT, **GREEDY, extra_body=IDS).model_dump()
    assert whole["prompt_token_ids"] == prompt
    [choice] = whole["choices"]
    assert text_of(http, choice["token_ids"]) == choice["message"]["content"] and len(choice["token_ids"]) == 6
    chunks = [c.model_dump() for c in client.chat.completions.create(model=model, messages=CHAT, stream=True,
                                                                     **GREEDY, extra_body=IDS)]
    assert chunks[0]["prompt_token_ids"] == prompt and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == choice["token_ids"]


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client, model, http):
    body = {"model": model, "prompt": PROMPT, "logprobs": 2, "echo": True, **GREEDY,
            "extra_body": {"return_tokens_as_token_ids": True, **IDS}}
    choice = client.completions.create(**body).choices[0]
    ids = [*tokens(http, PROMPT), *choice.model_dump()["token_ids"]]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in ids]  # the echoed prompt's too
    assert all(top is None or all(k.startswith("token_id:") for k in top) for top in choice.logprobs.top_logprobs)
    assert choice.logprobs.top_logprobs[-1][choice.logprobs.tokens[-1]] == choice.logprobs.token_logprobs[-1]
    chat = client.chat.completions.create(model=model, messages=CHAT, logprobs=True, top_logprobs=2, **GREEDY,
                                          extra_body={"return_tokens_as_token_ids": True, **IDS}).choices[0]
    content = chat.logprobs.content
    assert [e.token for e in content] == [f"token_id:{t}" for t in chat.model_dump()["token_ids"]]
    assert all(bytes(e.bytes).decode() == e.token and e.top_logprobs[0].token.startswith("token_id:") for e in content)
    # Off (the server's default): text.
    assert not client.completions.create(model=model, prompt=PROMPT, logprobs=1, max_tokens=2) \
        .choices[0].logprobs.tokens[0].startswith("token_id:")


def test_allowed_token_ids_restrict_what_is_sampled(client, model, http):
    allowed = tokens(http, " one two three")
    for temperature in (0, 1.5):
        choice = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=temperature, seed=1,
                                           extra_body={"allowed_token_ids": allowed, **IDS}).model_dump()["choices"][0]
        assert set(choice["token_ids"]) <= set(allowed) and len(choice["token_ids"]) == 8
    chat = client.chat.completions.create(model=model, messages=CHAT, **GREEDY,
                                          extra_body={"allowed_token_ids": allowed[:1], **IDS}).model_dump()
    assert chat["choices"][0]["token_ids"] == allowed[:1] * 6
    for bad, message in (([], "allowed_token_ids must not be an empty list"), ([5, 10**7, -3], "-3, 10000000")):
        with pytest.raises(openai.BadRequestError, match=message):
            client.completions.create(model=model, prompt=PROMPT, max_tokens=1, extra_body={"allowed_token_ids": bad})


def test_logprob_token_ids_give_the_logprobs_of_the_tokens_asked_for(client, model, http):
    top = client.completions.create(model=model, prompt=PROMPT, logprobs=5, max_tokens=1, temperature=0,
                                    extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    ranked = {int(k.removeprefix("token_id:")): v for k, v in top.top_logprobs[0].items()}
    asked = sorted(ranked)[:3] + [tokens(http, " zebra")[0]]
    choice = client.completions.create(model=model, prompt=PROMPT, logprobs=len(asked), max_tokens=1, temperature=0,
                                       extra_body={"logprob_token_ids": asked, "return_tokens_as_token_ids": True}
                                       ).choices[0].logprobs
    got = {int(k.removeprefix("token_id:")): v for k, v in choice.top_logprobs[0].items()}
    assert set(got) == {*asked, int(choice.tokens[0].removeprefix("token_id:"))}  # the sampled token's too
    for token_id in asked[:3]:
        assert got[token_id] == pytest.approx(ranked[token_id], abs=1e-4)
    assert got[asked[3]] < min(ranked.values())  # not in the top-5
    # Chat: every column, the sampled token first and once.
    entry = client.chat.completions.create(model=model, messages=CHAT, logprobs=True, max_tokens=1, temperature=0,
                                           extra_body={"logprob_token_ids": asked + asked[:1],
                                                       "return_tokens_as_token_ids": True}
                                           ).choices[0].logprobs.content[0]
    listed = [t.token for t in entry.top_logprobs]
    assert listed[0] == entry.token and len(listed) == len(set(listed))
    assert set(listed) == {entry.token, *(f"token_id:{t}" for t in asked)}
    for body, message in (({"logprob_token_ids": asked}, "logprobs"),  # needs logprobs
                          ({"logprob_token_ids": list(range(129)), "logprobs": 1}, "128")):
        r = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 1, **body})
        assert message in error_of(r)["message"]
    r = http.post("/v1/chat/completions", json={"model": model, "messages": CHAT, "logprob_token_ids": asked})
    assert error_of(r)["message"].startswith("logprob_token_ids can only be set when logprobs is true")


# ----------------------------------------------------------------------------- item 4: stream_options


def test_continuous_usage_needs_include_usage_as_in_vllm(http, model):
    def stream(options: dict) -> list[dict]:
        body = {"model": model, "prompt": PROMPT, **GREEDY, "stream": True, "stream_options": options}
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]

    off = stream({"include_usage": False, "continuous_usage_stats": True})
    assert all(c.get("usage") is None for c in off) and all(c["choices"] for c in off)
    # vLLM's StreamOptions.include_usage defaults to true once stream_options is sent.
    on = stream({"continuous_usage_stats": True})
    assert all(c["usage"] is not None for c in on) and on[-1]["choices"] == []
    assert on[-1]["usage"]["completion_tokens"] == 6
    final_only = stream({})
    assert [c.get("usage") is not None for c in final_only] == [False] * (len(final_only) - 1) + [True]


# ----------------------------------------------------------------------------- item 5: coercion


def test_compatible_json_types_are_coerced_as_in_vllm(http, model):
    r = http.post("/v1/chat/completions", json={"model": model, "messages": CHAT, "logprobs": "true",
                                                "top_logprobs": "2", "max_tokens": "5", "temperature": "0", "n": 1.0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert r.json()["usage"]["completion_tokens"] == 5 and len(choice["logprobs"]["content"][0]["top_logprobs"]) == 2
    r = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": "2", "echo": "false",
                                           "stream": 0, "logit_bias": {"5": "-100"}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_refused_values_are_all_named(http, model):
    error = error_of(http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "n": "two",
                                                        "temperature": "hot", "max_tokens": 1.5}))
    assert error["param"] == "n"
    for field in ("n:", "temperature:", "max_tokens:"):
        assert field in error["message"]
    error = error_of(http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 1,
                                                        "logit_bias": {"fox": 1, "12": 1, "dog": 2}}))
    assert "'fox'" in error["message"] and "'dog'" in error["message"] and "'12'" not in error["message"]
    error = error_of(http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 1,
                                                        "stop_token_ids": [2, 10**6, 10**7]}))
    assert "1000000, 10000000" in error["message"]


# ----------------------------------------------------------------------------- item 6: refused fields


@pytest.mark.parametrize("route, field, value", [
    ("completions", "prompt_embeds", "AAAA"),
    ("completions", "kv_transfer_params", {"do_remote_decode": True}),
    ("completions", "guided_decoding_backend", "xgrammar"),
    ("completions", "structural_tag", "{}"),
    ("completions", "response_format", {"type": "structural_tag"}),
    ("completions", "bad_words", ["the"]),
    ("completions", "suffix", "!"),
    ("chat/completions", "tool_choice", "auto"),  # without --enable-auto-tool-choice
    ("chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),  # tool_choice: 'auto'
    ("chat/completions", "reasoning_effort", "low"),
    ("chat/completions", "chat_template", "{{ messages }}"),
    ("chat/completions", "vllm_xargs", {"k": 1}),
])
def test_unimplemented_fields_are_a_400_naming_them(http, model, route, field, value):
    body = {"model": model, "max_tokens": 1, field: value,
            **({"prompt": PROMPT} if route == "completions" else {"messages": CHAT})}
    error = error_of(http.post(f"/v1/{route}", json=body))
    assert error["param"] == field and error["message"].startswith(field), error
    assert "is not supported: " in error["message"]


def test_fields_that_ask_for_nothing_pass(client, model):
    base = client.chat.completions.create(model=model, messages=CHAT, **GREEDY).choices[0].message.content
    same = client.chat.completions.create(model=model, messages=CHAT, **GREEDY, extra_body={
        "use_beam_search": False, "length_penalty": 1.0, "tool_choice": "none", "kv_transfer_params": None,
        "response_format": {"type": "text"}, "truncation_side": "left", "include_reasoning": False})
    assert same.choices[0].message.content == base
    # Tools with tool_choice "none" go to the chat template, as in vLLM; they are never called.
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert client.chat.completions.create(model=model, messages=CHAT, **GREEDY, tools=tools, tool_choice="none") \
        .choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="bad_words.*kv_transfer_params"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=1,
                                  extra_body={"bad_words": ["x"], "kv_transfer_params": {"x": 1}})
    with pytest.raises(openai.NotFoundError, match="my-lora"):  # a LoRA's name is an unknown model, as in vLLM
        client.completions.create(model="my-lora", prompt=PROMPT, max_tokens=1)
