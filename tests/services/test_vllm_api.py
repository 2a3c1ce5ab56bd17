"""vLLM's extensions of the OpenAI API (token ids in and out, stream_options, type coercion,
the fields kvmesh refuses), through `kvmesh serve` with the official `openai` client (vLLM's fields in
`extra_body`) or raw HTTP where the client cannot say it. Field names and shapes are vLLM's
(vllm/entrypoints/openai/{completion,chat_completion}/protocol.py); docs/serving/vllm_api.md lists them all.

On the session's shared stack (`serve`, tests/conftest.py); small max_tokens throughout.
"""

from __future__ import annotations

import json
import re

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


EMOJI_CHAT = [{"role": "system", "content": "You like to use emojis in your responses."},
              {"role": "user", "content": "Repeat after me: I love cats 🐱"}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given location",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}
WEATHER_CHAT = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What's the weather like in Paris?"}]


def check_chat_token_ids(client, model: str, http, **body) -> dict:
    """A chat answer with return_token_ids, whole and streamed, in vLLM's shape; the whole answer."""
    template_inputs = {"tools": body["tools"]} if "tools" in body else {}  # what chat hands the template
    prompt = http.post("/tokenize", json={"messages": body["messages"],
                                          "chat_template_kwargs": template_inputs}).json()["tokens"]
    whole = client.chat.completions.create(model=model, **body, extra_body=IDS).model_dump()
    assert whole["prompt_token_ids"] == prompt
    [choice] = whole["choices"]
    assert choice["token_ids"] and len(choice["token_ids"]) == whole["usage"]["completion_tokens"]
    chunks = [c.model_dump() for c in client.chat.completions.create(model=model, **body, stream=True,
                                                                     extra_body=IDS)]
    # vLLM's chunks: the prompt's ids on the role chunk and nowhere after (no key, not even null);
    # the role chunk has no token_ids; every chunk after it its new ids.
    assert chunks[0]["prompt_token_ids"] == prompt and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "token_ids" not in chunks[0]["choices"][0]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    return whole


def test_chat_returns_prompt_and_output_token_ids(client, model, http):
    whole = check_chat_token_ids(client, model, http, messages=CHAT, **GREEDY)
    [choice] = whole["choices"]
    assert text_of(http, choice["token_ids"]) == choice["message"]["content"] and len(choice["token_ids"]) == 6
    # Text that is not one token per character: the ids are still all there, the prompt's and the answer's.
    whole = check_chat_token_ids(client, model, http, messages=EMOJI_CHAT, temperature=0, max_tokens=12)
    assert "I love cats 🐱" in text_of(http, whole["prompt_token_ids"])
    # The ids end with the end-of-turn token, which the text leaves out (as in vLLM).
    [choice] = whole["choices"]
    assert text_of(http, choice["token_ids"]) == choice["message"]["content"] + "<|im_end|>"
    # With tools: a call's tokens are ids like any others.
    whole = check_chat_token_ids(client, model, http, messages=WEATHER_CHAT, tools=[WEATHER_TOOL],
                                 tool_choice="required", temperature=0, max_tokens=30)
    assert whole["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    # Not asked for: null on the role chunk and on each delta chunk, as vLLM writes them.
    chunks = [c.model_dump() for c in client.chat.completions.create(model=model, messages=CHAT, stream=True,
                                                                     **GREEDY)]
    assert chunks[0]["prompt_token_ids"] is None and all(c["choices"][0]["token_ids"] is None for c in chunks[1:])


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


def test_token_ids_agree_with_logprobs_and_prompt_logprobs(client, model):
    # vLLM's test_comparison_with_prompt_logprobs_and_logprobs: with ids as logprob tokens, the
    # echoed logprobs name the prompt's ids then the answer's, and the prompt logprobs score the same ids.
    choice = client.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=1, **GREEDY, extra_body={
        "return_token_ids": True, "return_tokens_as_token_ids": True, "prompt_logprobs": 1,
        "ignore_eos": True}).choices[0]
    named = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
    assert named == choice.prompt_token_ids + choice.token_ids and len(choice.token_ids) == 6
    assert len(choice.prompt_logprobs) == len(choice.prompt_token_ids) and choice.prompt_logprobs[0] is None
    for position, (token, scored) in enumerate(zip(choice.prompt_token_ids[1:], choice.prompt_logprobs[1:]), 1):
        assert scored[str(token)]["logprob"] == pytest.approx(choice.logprobs.token_logprobs[position], abs=1e-4)
    # Streamed: the prompt's ids in the first chunk; each chunk's ids those its logprobs name.
    chunks = list(client.completions.create(model=model, prompt=PROMPT, logprobs=1, stream=True, **GREEDY,
                                            extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True,
                                                        "ignore_eos": True}))
    assert chunks[0].choices[0].prompt_token_ids == choice.prompt_token_ids
    for chunk in chunks:
        ids = [int(t.removeprefix("token_id:")) for t in chunk.choices[0].logprobs.tokens]
        assert ids == chunk.choices[0].token_ids
    assert [t for c in chunks for t in c.choices[0].token_ids] == choice.token_ids


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


def test_chat_prompt_logprobs_list_the_prompt_token_and_the_top_n(client, model, http):
    # As vLLM lists them: per prompt token (None for the first) the token itself and the top N, so N
    # entries where it is among the top N and N + 1 where it is not; the numbers are those the
    # same ids get as a completion's prompt.
    prompt = http.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    for n in (1, 2):
        positions = client.chat.completions.create(model=model, messages=CHAT, max_tokens=1,
                                                   extra_body={"prompt_logprobs": n}).prompt_logprobs
        assert len(positions) == len(prompt) and positions[0] is None
        for token, position in zip(prompt[1:], positions[1:]):
            rank = position[str(token)]["rank"]
            assert len(position) == (n if rank <= n else n + 1)
            assert {e["rank"] for t, e in position.items() if t != str(token)} | {rank} >= set(range(1, n + 1))
        if n == 1:
            assert {len(p) for p in positions[1:]} == {1, 2}  # both cases occur in this prompt
        same = client.completions.create(model=model, prompt=prompt, max_tokens=1,
                                          extra_body={"prompt_logprobs": n}).choices[0].prompt_logprobs
        for position, other in zip(positions[1:], same[1:]):
            assert position.keys() == other.keys()
            assert [e["logprob"] for e in position.values()] == \
                pytest.approx([e["logprob"] for e in other.values()], abs=1e-4)


# ----------------------------------------------------------------------------- item 4: stream_options


def test_stream_usage_follows_vllms_rules(http, model):
    def stream(route: str, options: dict, **body) -> list[dict]:
        body = {"model": model, **GREEDY, **body, "stream": True, "stream_options": options}
        with http.stream("POST", f"/v1/{route}", json=body) as r:
            assert r.status_code == 200
            events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]

    # include_usage defaults to false, as OpenAI's and vLLM's StreamOptions: no usage without it, and
    # continuous_usage_stats alone asks for nothing.
    for options in ({}, {"continuous_usage_stats": True}, {"include_usage": False, "continuous_usage_stats": True}):
        chunks = stream("completions", options, prompt=PROMPT)
        assert all(c.get("usage") is None and c["choices"] for c in chunks), options
    final_only = stream("completions", {"include_usage": True}, prompt=PROMPT)
    assert [c.get("usage") is not None for c in final_only] == [False] * (len(final_only) - 1) + [True]
    # Continuous usage is each chunk's choice's, as vLLM counts it: its prompt's tokens and its own
    # so far (the role chunk's, none yet); the last chunk sums the request.
    both = {"include_usage": True, "continuous_usage_stats": True}
    chunks = stream("chat/completions", both, messages=CHAT, n=2, return_token_ids=True, ignore_eos=True)
    prompt_tokens = len(chunks[0]["prompt_token_ids"])
    seen = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        [choice] = chunk["choices"]
        seen[choice["index"]] += len(choice.get("token_ids", []))
        assert chunk["usage"]["prompt_tokens"] == prompt_tokens
        assert chunk["usage"]["completion_tokens"] == seen[choice["index"]]
    assert seen == {0: 6, 1: 6} and chunks[-1]["choices"] == []
    assert (chunks[-1]["usage"]["prompt_tokens"], chunks[-1]["usage"]["completion_tokens"]) == (prompt_tokens, 12)
    prompts = [PROMPT, "1, 2, 3,"]
    prompt_lengths = [len(tokens(http, p)) for p in prompts]
    chunks = stream("completions", both, prompt=prompts, return_token_ids=True, ignore_eos=True)
    counted: dict[int, int] = {}
    for chunk in chunks[:-1]:
        [choice] = chunk["choices"]
        counted[choice["index"]] = counted.get(choice["index"], 0) + len(choice["token_ids"])
        assert chunk["usage"]["completion_tokens"] == counted[choice["index"]]
        assert chunk["usage"]["prompt_tokens"] == prompt_lengths[choice["index"]]
    assert chunks[-1]["usage"]["completion_tokens"] == 12


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


def test_error_bodies_say_what_vllms_clients_match(client, model):
    # A seed beyond 64 bits: pydantic's error type in the message, as vLLM's 400 shows it.
    for seed, words in ((2**63, "less_than_equal"), (-(2**63) - 1, "greater_than_equal")):
        with pytest.raises(openai.BadRequestError, match=words) as refused:
            client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=1, seed=seed)
        assert refused.value.param == "seed"
    for seed in (2**63 - 1, -(2**63)):
        assert client.completions.create(model=model, prompt=PROMPT, max_tokens=1, seed=seed).choices[0].text
    # kvmesh's wire carries priority and top_k in 32 bits: beyond them, the same kind of 400.
    with pytest.raises(openai.BadRequestError, match=r"priority: .*\(less_than_equal\)"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=1, extra_body={"priority": 2**31})
    # An empty prompt, or none: vLLM's words.
    empty = re.escape("Either prompt or prompt_embeds must be provided and non-empty.")
    for prompt, extra in (("", {}), ([], {}), (None, {"prompt_embeds": []})):
        with pytest.raises(openai.BadRequestError, match=empty) as refused:
            client.completions.create(model=model, prompt=prompt, max_tokens=5, extra_body=extra)
        assert refused.value.param == "prompt"


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
