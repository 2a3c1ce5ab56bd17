"""vLLM's server flags, through one `kvmesh serve` started with all of them:
--root-path, --enable-request-id-headers, --enable-force-include-usage,
--enable-tokenizer-info-endpoint, --max-logprobs -1 (logprobs of the whole vocabulary) and
--enable-auto-tool-choice --tool-call-parser hermes; and
--dtype half on the CPU, on a stack of its own. The defaults (no X-Request-Id, no /tokenizer_info,
at most 20 logprobs) are checked on the session's shared stack.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from services.processor.tokenizer import load_tokenizer
from services.worker.kv_cache import KVCacheSpec
from tests.model.hf_reference import HFReference
from tests.services.procs import SERVE_KV_BYTES, Serve, client_for, gateway_over, running_serve
from tests.services.test_vllm_api import WEATHER_CHAT, WEATHER_TOOL
from tests.unit.test_metrics import samples

ROOT_PATH = "/kvmesh"
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def flagged(serve: Serve) -> Iterator[Serve]:
    """A gateway with the flags, in front of the shared stack: all of them are the gateway's."""
    with gateway_over(serve, ["--root-path", ROOT_PATH, "--enable-request-id-headers", "--enable-force-include-usage",
                              "--enable-tokenizer-info-endpoint", "--max-logprobs", "-1",
                              "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def http(flagged: Serve) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=flagged.api.removesuffix("/v1"), timeout=120) as http:
        yield http


@pytest.fixture(scope="module")
def vocab_size(model_path: Path) -> int:
    return len(load_tokenizer(model_path))


def test_root_path_serves_the_api_as_a_stripping_proxy_forwards_it(flagged: Serve, http):
    # The proxy takes /kvmesh/v1/models and forwards /v1/models; the API names its prefix in its
    # OpenAPI document, so links and generated clients point through the proxy.
    client, model = client_for(flagged)
    assert client.completions.create(model=model, prompt="Hi", max_tokens=1).choices[0].finish_reason
    assert http.get("/openapi.json").json()["servers"] == [{"url": ROOT_PATH}]
    assert http.get("/health").status_code == 200


def test_request_id_headers_on_every_response(http):
    given = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"X-Request-Id": "r-42"})
    assert given.headers["X-Request-Id"] == "r-42" and given.json()["id"] == "cmpl-r-42"
    made = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert made.json()["id"] == f"cmpl-{made.headers['X-Request-Id']}"
    assert http.get("/health", headers={"X-Request-Id": "probe"}).headers["X-Request-Id"] == "probe"
    missing = http.post("/v1/completions", json={"model": "nope", "prompt": "Hi"}, headers={"X-Request-Id": "e-1"})
    assert missing.status_code == 404 and missing.headers["X-Request-Id"] == "e-1"


def test_no_request_id_header_by_default(serve: Serve):
    with httpx.Client(base_url=serve.api.removesuffix("/v1"), timeout=120) as http:
        response = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                             headers={"X-Request-Id": "r-1"})
        assert response.json()["id"] == "cmpl-r-1" and "X-Request-Id" not in response.headers
        assert "X-Request-Id" not in http.get("/health").headers


def test_force_include_usage_puts_usage_on_every_chunk(flagged: Serve):
    # vLLM's test_enable_force_include_usage: usage on every chunk, its completion tokens growing
    # chunk by chunk, then a usage chunk with no choices; whatever stream_options say.
    client, model = client_for(flagged)
    for stream_options in (None, {"include_usage": False}):
        chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, temperature=0,
                                                     stream=True, stream_options=stream_options,
                                                     extra_body={"ignore_eos": True}))
        assert [c.usage.completion_tokens for c in chunks] == [0, 1, 2, 3, 3] and chunks[-1].choices == []
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
        assert len({c.usage.prompt_tokens for c in chunks}) == 1 and chunks[0].usage.prompt_tokens > 0
    chunks = list(client.completions.create(model=model, prompt="Hi", max_tokens=2, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert [c.usage.completion_tokens for c in chunks] == [1, 2, 2] and chunks[-1].choices == []
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 2


def test_auto_tool_choice_answers_carry_token_ids(flagged: Serve, http):
    # vLLM's test_chat_completion_with_tool_use, under --enable-auto-tool-choice --tool-call-parser hermes.
    client, model = client_for(flagged)
    body = {"model": model, "messages": WEATHER_CHAT, "tools": [WEATHER_TOOL], "tool_choice": "auto",
            "max_tokens": 20, "temperature": 0, "logprobs": True}
    whole = client.chat.completions.create(**body, extra_body={"return_token_ids": True}).model_dump()
    [choice] = whole["choices"]
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"] == len(choice["logprobs"]["content"])
    prompt = http.post("/detokenize", json={"tokens": whole["prompt_token_ids"]}).json()["prompt"]
    assert "What's the weather like in Paris?" in prompt
    chunks = [c.model_dump() for c in client.chat.completions.create(**body, stream=True,
                                                                     extra_body={"return_token_ids": True})]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert [t for c in chunks[1:] if c["choices"] for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    without = client.chat.completions.create(**body).model_dump()
    assert without["prompt_token_ids"] is None and without["choices"][0]["token_ids"] is None


def test_tokenizer_info_is_the_tokenizers_configuration(http, model_path: Path):
    tokenizer = load_tokenizer(model_path)
    info = http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == tokenizer.model_max_length
    assert info["eos_token"] == tokenizer.eos_token
    assert "vocab_file" not in info and "merges_file" not in info
    # Added tokens as their text (vLLM's rendering of AddedToken).
    assert info["added_tokens_decoder"]["0"] == tokenizer.convert_ids_to_tokens(0)


def test_no_tokenizer_info_by_default(serve: Serve):
    with httpx.Client(base_url=serve.api.removesuffix("/v1"), timeout=120) as http:
        assert http.get("/tokenizer_info").status_code == 404


def test_logprobs_of_the_whole_vocabulary(flagged: Serve, vocab_size: int):
    client, model = client_for(flagged)
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=1, temperature=0, logprobs=True,
                                          top_logprobs=-1)
    [token] = chat.choices[0].logprobs.content
    assert len(token.top_logprobs) == vocab_size
    assert token.top_logprobs[0].token == token.token and token.top_logprobs[0].logprob == token.logprob
    more = client.completions.create(model=model, prompt="The sky is", max_tokens=2, temperature=0, logprobs=30)
    assert all(len(top) >= 29 for top in more.choices[0].logprobs.top_logprobs)  # above vLLM's default 20
    prompt = client.completions.create(model=model, prompt="The sky is", max_tokens=1,
                                       extra_body={"prompt_logprobs": -1})
    entries = prompt.choices[0].prompt_logprobs
    assert entries[0] is None and all(len(e) == vocab_size for e in entries[1:])
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=model, prompt="Hi", max_tokens=1, extra_body={"prompt_logprobs": -2})
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.completions.create(model=model, prompt="Hi", max_tokens=1, logprobs=vocab_size + 1)


def test_whole_vocabulary_needs_the_limit_lifted(serve: Serve):
    client, model = client_for(serve)
    with pytest.raises(openai.BadRequestError, match="--max-logprobs"):
        client.completions.create(model=model, prompt="Hi", max_tokens=1, logprobs=-1)
    with pytest.raises(openai.BadRequestError, match="--max-logprobs"):
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=1, logprobs=True, top_logprobs=-1)


def test_dtype_half_serves_float16_on_the_cpu(model_path: Path):
    # vLLM's `--dtype half`: float16 weights and KV cache. Its greedy tokens are transformers' in float16
    # (teacher forcing: each is the reference's argmax after the tokens before it), its logprobs within
    # float16's rounding, and the KV budget holds twice the blocks of float32's.
    prompt = "The capital of France is"
    with running_serve(model_path, extra_args=["--dtype", "half", "--max-model-len", "256"]) as serve:
        client, model = client_for(serve)
        completion = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=1,
                                               extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0)
        metrics = samples(httpx.get(serve.services["gateway"]["metrics"], timeout=30).content)
    logprobs = completion.choices[0].logprobs
    tokens = [int(t.removeprefix("token_id:")) for t in logprobs.tokens]
    reference = HFReference(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float16).eval())
    scored = reference(load_tokenizer(model_path).encode(prompt), tokens)
    assert tokens == scored.token_ids
    want = [scored.logprobs[i, token].item() for i, token in enumerate(tokens)]
    assert logprobs.token_logprobs == pytest.approx(want, abs=0.1)
    assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("stop", "length")
    config = AutoConfig.from_pretrained(model_path)
    spec = KVCacheSpec(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 16, torch.float16)
    [info] = [dict(labels) for name, labels in metrics if name == "vllm:cache_config_info"]
    assert int(info["num_gpu_blocks"]) == SERVE_KV_BYTES // spec.bytes_per_block
