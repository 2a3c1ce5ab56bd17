"""Every endpoint and parameter of the OpenAI API, driven by the official `openai` client against
`kvmesh serve` (gateway, processor, engine and worker as real processes on loopback).

On the session's shared stack (`serve`, tests/conftest.py): a 256-token context (so that
"longer than the context" is cheap), one running sequence at a time under the priority policy (so
that priorities decide the order in which queued requests run); small max_tokens throughout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx2 as httpx
import openai
import pytest

from tests.services.procs import SHARED_MAX_MODEL_LEN as MAX_MODEL_LEN
from tests.services.procs import Serve

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_tokens": 8}
CHAT = [{"role": "user", "content": "Name three colours."}]
# A prompt of more than two 16-token blocks, so that a repeat of it hits the prefix cache.
LONG_PROMPT = ("Rivers carry water from the mountains to the sea, shaping valleys, feeding fields and "
               "giving towns along their banks a reason to exist. Tell me about one.")


@pytest.fixture(scope="module")
def client(serve: Serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve.api, api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def http(serve: Serve) -> Iterator[httpx.Client]:
    """For vLLM's routes outside /v1 (/tokenize, /detokenize, /version), which the client has no method for."""
    with httpx.Client(base_url=serve.api.removesuffix("/v1"), timeout=60) as http:
        yield http


def token_id(http: httpx.Client, text: str) -> int:
    [token] = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    return token


# ----------------------------------------------------------------------------- /v1/completions


def test_prompt_forms_and_their_choices(client, model, http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    text = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
    assert text.id.startswith("cmpl-") and text.object == "text_completion" and text.model == model
    [choice] = text.choices
    assert choice.text and choice.finish_reason == "length" and text.usage.completion_tokens == 8
    assert text.usage.prompt_tokens == len(ids) and text.usage.total_tokens == len(ids) + 8
    # The same prompt as token ids gives the same text.
    assert client.completions.create(model=model, prompt=ids, **GREEDY).choices[0].text == choice.text
    # Several prompts, strings or token-id lists: each its own n choices, numbered prompt by prompt.
    for prompts in ([PROMPT, "1, 2, 3,"], [ids, http.post("/tokenize", json={"prompt": "1, 2, 3,"}).json()["tokens"]]):
        many = client.completions.create(model=model, prompt=prompts, n=2, **GREEDY)
        assert [c.index for c in many.choices] == [0, 1, 2, 3]
        texts = [c.text for c in many.choices]
        assert texts[0] == texts[1] == choice.text and texts[2] == texts[3] != choice.text
        assert many.usage.completion_tokens == 32


def test_streamed_equals_whole_under_greedy_with_usage_on_every_chunk(client, model):
    body = {"model": model, "prompt": PROMPT, "logprobs": 2, **GREEDY}
    whole = client.completions.create(**body)
    chunks = list(client.completions.create(**body, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    tokens = [t for c in chunks if c.choices for t in c.choices[0].logprobs.tokens]
    assert tokens == whole.choices[0].logprobs.tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    completion_tokens = [c.usage.completion_tokens for c in chunks]  # continuous usage: on every chunk
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[0] >= 1
    assert all(c.usage.prompt_tokens == whole.usage.prompt_tokens for c in chunks)
    # Without continuous_usage_stats, only the last chunk has usage.
    plain = list(client.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_seeded_choices_differ_and_repeat(client, model):
    body = {"model": model, "prompt": "My favourite animal is", "max_tokens": 8, "n": 3, "seed": 7,
            "temperature": 1.0}
    texts = [c.text for c in client.completions.create(**body).choices]
    assert len(set(texts)) == 3
    assert [c.text for c in client.completions.create(**body).choices] == texts
    other = [c.text for c in client.completions.create(**{**body, "seed": 8}).choices]
    assert other != texts


def test_logprobs_give_the_top_n_plus_the_sampled_token(client, model):
    choice = client.completions.create(model=model, prompt=PROMPT, logprobs=5, **GREEDY).choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and len(lp.tokens) == 8
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) in (5, 6) and top[token] == logprob  # greedy: the sampled token is the top one
        assert logprob == max(top.values()) and logprob <= 0
    sampled = client.completions.create(model=model, prompt=PROMPT, logprobs=1, max_tokens=8, temperature=1.5,
                                        seed=3).choices[0].logprobs
    for token, top in zip(sampled.tokens, sampled.top_logprobs):
        assert token in top and len(top) in (1, 2)  # the top one, and the sampled one when it differs
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=model, prompt=PROMPT, logprobs=21, max_tokens=2)


def test_echo_returns_the_prompt_with_its_logprobs(client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, **GREEDY).choices[0].text
    echoed = client.completions.create(model=model, prompt=PROMPT, echo=True, **GREEDY).choices[0]
    assert echoed.text == PROMPT + whole
    with_lp = client.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=2, **GREEDY).choices[0]
    lp = with_lp.logprobs
    assert with_lp.text == PROMPT + whole and "".join(lp.tokens) == PROMPT + whole
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None for x in lp.token_logprobs[1:]) and all(len(t) in (2, 3) for t in lp.top_logprobs[1:])
    assert lp.text_offset[-8] == len(PROMPT)
    # max_tokens 0: the prompt scored, nothing generated (as lm-eval-harness asks).
    scored = client.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=0, max_tokens=0).choices[0]
    assert scored.text == PROMPT and scored.logprobs.token_logprobs[1:] == lp.token_logprobs[1:-8]
    streamed = list(client.completions.create(model=model, prompt=PROMPT, echo=True, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == PROMPT + whole


def test_sampling_knobs_change_the_text_as_documented(client, model, http):
    greedy = client.completions.create(model=model, prompt=PROMPT, **GREEDY).choices[0].text
    # Each of these leaves only the most likely token to sample from.
    for knob in ({"top_p": 1e-6}, {"extra_body": {"top_k": 1}}, {"extra_body": {"min_p": 1.0}}):
        sampled = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=1, **knob)
        assert sampled.choices[0].text == greedy, knob
    assert client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                     seed=1).choices[0].text != greedy
    the = token_id(http, " the")
    forced = client.completions.create(model=model, prompt=PROMPT, logit_bias={str(the): 100}, **GREEDY)
    assert forced.choices[0].text == " the" * 8
    banned = client.completions.create(model=model, prompt="the the the the the the", logit_bias={str(the): -100},
                                       **GREEDY)
    assert " the" not in banned.choices[0].text
    # Greedy, the answer repeats a newline; each penalty on tokens already generated prevents that.
    assert "\n\n" in greedy
    for penalty in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"extra_body": {"repetition_penalty": 2.0}}):
        penalised = client.completions.create(model=model, prompt=PROMPT, **GREEDY, **penalty).choices[0].text
        assert "\n\n" not in penalised, penalty


def test_stops_min_tokens_and_eos(client, model, http):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    stop = whole.split()[2]
    cut = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == whole[:whole.index(stop)] and cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True}).choices[0]
    assert kept.text == whole[:whole.index(stop) + len(stop)]
    # A stop token id: forced by logit_bias, it ends the choice at once; min_tokens holds it off.
    the = token_id(http, " the")
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logit_bias": {str(the): 100}}
    stopped = client.completions.create(**body, extra_body={"stop_token_ids": [the]})
    assert stopped.choices[0].text == "" and stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].stop_reason == the and stopped.usage.completion_tokens == 1
    held = client.completions.create(**body, extra_body={"stop_token_ids": [the], "min_tokens": 3})
    assert held.usage.completion_tokens == 4 and held.choices[0].stop_reason == the
    # EOS: forced, it ends the choice (reason stop, no stop_reason); ignore_eos generates on.
    eos = token_id(http, "<|im_end|>")
    body["logit_bias"] = {str(eos): 100}
    ended = client.completions.create(**body).choices[0]
    assert ended.text == "" and ended.finish_reason == "stop" and ended.stop_reason is None
    assert client.completions.create(**body, extra_body={"ignore_eos": True}).usage.completion_tokens == 8


def test_special_tokens_in_the_text(client, model, http):
    start = token_id(http, "<|im_start|>")
    body = {"model": model, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logit_bias": {str(start): 100}}
    assert client.completions.create(**body).choices[0].text == ""
    shown = client.completions.create(**body, extra_body={"skip_special_tokens": False,
                                                          "spaces_between_special_tokens": False})
    assert shown.choices[0].text == "<|im_start|>" * 3


def test_max_tokens_is_clamped_to_the_context(client, model, http):
    prompt = "one two " * 120
    num_prompt = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    assert MAX_MODEL_LEN - 20 < num_prompt < MAX_MODEL_LEN
    out = client.completions.create(model=model, prompt=prompt, max_tokens=1000, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == MAX_MODEL_LEN - num_prompt and out.choices[0].finish_reason == "length"
    default = client.completions.create(model=model, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens


def test_prompt_logprobs(client, model, http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    choice = client.completions.create(model=model, prompt=PROMPT, max_tokens=1,
                                       extra_body={"prompt_logprobs": 2}).choices[0]
    positions = choice.prompt_logprobs
    assert len(positions) == len(ids) and positions[0] is None
    for token, position in zip(ids[1:], positions[1:]):
        assert str(token) in position and 2 <= len(position) <= 3
        assert {e["rank"] for e in position.values()} >= {1, 2} and position[str(token)]["decoded_token"]
    # The same numbers as echo's prompt logprobs.
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, echo=True, logprobs=2).choices[0]
    assert echoed.logprobs.token_logprobs[1:len(ids)] == pytest.approx(
        [p[str(t)]["logprob"] for t, p in zip(ids[1:], positions[1:])])
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert chat.prompt_logprobs[0] is None and len(chat.prompt_logprobs) == chat.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1})


def test_truncate_prompt_tokens_keeps_the_last_tokens_or_with_side_right_the_first(client, model, http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    for side, kept in (("left", ids[-3:]), (None, ids[-3:]), ("right", ids[:3])):
        out = client.completions.create(model=model, prompt=PROMPT, echo=True, max_tokens=1, temperature=0,
                                        extra_body={"truncate_prompt_tokens": 3, "truncation_side": side})
        assert out.usage.prompt_tokens == 3
        assert out.choices[0].text.startswith(http.post("/detokenize", json={"tokens": kept}).json()["prompt"]), side
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": MAX_MODEL_LEN + 1})


def test_cache_salt_separates_the_prefix_cache(client, model):
    def cached(salt: str | None, prompt: str) -> int:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=1,
                                        extra_body={"cache_salt": salt} if salt else None)
        return out.usage.prompt_tokens_details.cached_tokens

    prompt = f"{LONG_PROMPT} ({time.monotonic_ns()})"  # new to the cache
    assert cached("tenant-a", prompt) == 0
    assert cached("tenant-a", prompt) >= 32
    assert cached("tenant-b", prompt) == 0
    assert cached(None, prompt) == 0
    assert cached(None, prompt) >= 32
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=1, extra_body={"cache_salt": ""})


def test_priority_orders_the_waiting_requests(client, model, serve):
    """One sequence runs at a time: a blocker runs, then a low and (later) a high priority request
    wait; the high one runs first."""
    finished: list[str] = []
    started = threading.Event()

    def blocker() -> None:
        for _ in client.completions.create(model=model, prompt=PROMPT, max_tokens=60, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
            started.set()
        finished.append("blocker")

    def request(name: str, priority: int) -> None:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body={"priority": priority})
        finished.append(name)

    threads = [threading.Thread(target=blocker)]
    threads[0].start()
    assert started.wait(60)
    for name, priority in (("low", 10), ("high", -10)):
        threads.append(threading.Thread(target=request, args=(name, priority)))
        threads[-1].start()
        deadline = time.monotonic() + 10
        while serve.engine_stats().num_waiting < len(threads) - 1:
            assert time.monotonic() < deadline, "the request did not reach the engine's queue"
            time.sleep(0.01)
    assert not finished, "the blocker ended before both requests were queued; make it longer"
    for t in threads:
        t.join(60)
    assert finished == ["blocker", "high", "low"]


def test_request_ids_user_and_unsupported_fields(client, model):
    raw = client.completions.with_raw_response.create(model=model, prompt=PROMPT, max_tokens=1, user="alice",
                                                      extra_body={"request_id": "from-body"})
    # Without --enable-request-id-headers (vLLM's default) no response carries X-Request-Id.
    assert raw.parse().id == "cmpl-from-body" and "X-Request-Id" not in raw.headers
    raw = client.chat.completions.with_raw_response.create(model=model, messages=CHAT, max_tokens=1,
                                                           extra_body={"request_id": "from-body"},
                                                           extra_headers={"X-Request-Id": "from-header"})
    assert raw.parse().id == "chatcmpl-from-header" and "X-Request-Id" not in raw.headers
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=1, suffix="!")


# ----------------------------------------------------------------------------- /v1/chat/completions


def test_chat_messages_multi_turn_and_text_parts(client, model):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": [{"type": "text", "text": "Name three"}, {"type": "text", "text": "colours."}]}]
    reply = client.chat.completions.create(model=model, messages=messages, **GREEDY)
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    [choice] = reply.choices
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason in ("stop", "length")
    joined = [*messages[:3], {"role": "user", "content": "Name three\ncolours."}]
    assert client.chat.completions.create(model=model, messages=joined, **GREEDY).choices[0].message.content == \
        choice.message.content
    # A system message and earlier turns are part of the prompt.
    assert reply.usage.prompt_tokens > client.chat.completions.create(
        model=model, messages=messages[3:], max_tokens=1).usage.prompt_tokens
    newer = client.chat.completions.create(model=model, messages=messages, temperature=0, max_completion_tokens=3)
    assert newer.usage.completion_tokens == 3 and newer.choices[0].finish_reason == "length"
    streamed = list(client.chat.completions.create(model=model, messages=messages, stream=True, **GREEDY))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == choice.message.content


def test_chat_logprobs_n_stop_seed(client, model):
    reply = client.chat.completions.create(model=model, messages=CHAT, logprobs=True, top_logprobs=3, **GREEDY)
    content = reply.choices[0].logprobs.content
    assert "".join(e.token for e in content) == reply.choices[0].message.content
    for entry in content:
        assert bytes(entry.bytes).decode() == entry.token and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    plain = client.chat.completions.create(model=model, messages=CHAT, logprobs=True, **GREEDY)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    sampled = client.chat.completions.create(model=model, messages=CHAT, n=3, seed=5, temperature=1.0, max_tokens=8)
    assert len({c.message.content for c in sampled.choices}) == 3
    word = reply.choices[0].message.content.split()[1]
    stopped = client.chat.completions.create(model=model, messages=CHAT, stop=[word], **GREEDY).choices[0]
    assert word not in stopped.message.content and stopped.finish_reason == "stop"


def test_chat_response_format_echo_and_continuation(client, model):
    text = client.chat.completions.create(model=model, messages=CHAT, response_format={"type": "text"}, **GREEDY)
    assert text.choices[0].message.content
    partial = [*CHAT, {"role": "assistant", "content": "Red, green"}]
    continued = client.chat.completions.create(
        model=model, messages=partial, **GREEDY,
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "echo": True})
    assert continued.choices[0].message.content.startswith("Red, green")
    alone = client.chat.completions.create(
        model=model, messages=partial, **GREEDY, extra_body={"add_generation_prompt": False,
                                                             "continue_final_message": True})
    assert continued.choices[0].message.content == "Red, green" + alone.choices[0].message.content
    # With a generation prompt the last message (the user's) is not the answer's: nothing to echo.
    assert client.chat.completions.create(model=model, messages=CHAT, **GREEDY, extra_body={"echo": True}) \
        .choices[0].message.content == text.choices[0].message.content


def test_chat_template_kwargs_are_whitelisted(client, model):
    base = client.chat.completions.create(model=model, messages=CHAT, **GREEDY).choices[0].message.content
    # A key the template does not read is dropped (a client may send it to every model).
    ignored = client.chat.completions.create(model=model, messages=CHAT, **GREEDY,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert ignored.choices[0].message.content == base
    with pytest.raises(openai.BadRequestError, match="chat_template"):
        client.chat.completions.create(model=model, messages=CHAT, **GREEDY,
                                       extra_body={"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}})


# ----------------------------------------------------------------------------- tokens, models, errors


def test_tokenize_and_detokenize(http, client, model):
    out = http.post("/tokenize", json={"model": model, "prompt": PROMPT, "return_token_strs": True}).json()
    assert out["count"] == len(out["tokens"]) == client.completions.create(
        model=model, prompt=PROMPT, max_tokens=1).usage.prompt_tokens
    assert out["max_model_len"] == MAX_MODEL_LEN and "".join(out["token_strs"]).replace("Ġ", " ") == PROMPT
    assert http.post("/detokenize", json={"model": model, "tokens": out["tokens"]}).json() == {"prompt": PROMPT}
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] == client.chat.completions.create(model=model, messages=CHAT, max_tokens=1).usage.prompt_tokens
    assert chat["token_strs"] is None
    without = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert without["tokens"] == chat["tokens"][:len(without["tokens"])] and without["count"] < chat["count"]
    rendered = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert rendered.endswith("<|im_start|>assistant\n") and "Name three colours." in rendered
    assert http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"] == out["tokens"]
    for bad in ({"tokens": [10**6]}, {"tokens": [-1]}):
        r = http.post("/detokenize", json=bad)
        assert r.status_code == 400 and "out of vocabulary" in r.json()["error"]["message"]
    r = http.post("/tokenize", json={"prompt": PROMPT, "messages": CHAT})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert http.post("/tokenize", json={"prompt": PROMPT, "model": "nope"}).status_code == 404


def test_models_and_version(client, model, http):
    [card] = client.models.list().data
    assert card.id == model and card.object == "model" and card.max_model_len == MAX_MODEL_LEN
    assert http.get("/version").json()["version"]


def test_invalid_input_is_a_400_that_says_why(client, model):
    with pytest.raises(openai.BadRequestError, match=rf"has \d+ tokens; .* {MAX_MODEL_LEN} tokens"):
        client.completions.create(model=model, prompt="word " * 300, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="out of vocabulary"):
        client.completions.create(model=model, prompt=[1, 10**6], max_tokens=1)
    for empty in ("", [], [[]]):
        with pytest.raises(openai.BadRequestError, match="empty"):
            client.completions.create(model=model, prompt=empty, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=1, stream_options={"include_usage": True})
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=1, logprobs=True, top_logprobs=21)
