"""The pieces of internal security that need no server: where the token comes from, the
interceptor's comparison, and the checks a request meets before the engine queues it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from services.common.config import SecurityConfig
from services.common.engine_output import EngineCoreRequest
from services.common.rpc.security import TOKEN_ENV, RpcSecurity, TokenInterceptor, read_token
from services.common.sampling_params import REALS, SamplingParams
from services.common.validation import MAX_STOP_TOKEN_IDS, check_engine_request


def test_the_token_comes_from_the_file_then_the_environment(tmp_path: Path):
    token_file = tmp_path / "token"
    token_file.write_text("  s3cret\n")
    assert read_token(SecurityConfig(internal_token_file=token_file), {TOKEN_ENV: "other"}) == "s3cret"
    assert read_token(SecurityConfig(), {TOKEN_ENV: "from-env"}) == "from-env"
    assert read_token(SecurityConfig(), {}) is None
    token_file.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        read_token(SecurityConfig(internal_token_file=token_file), {})
    with pytest.raises(ValueError, match="empty"):
        read_token(SecurityConfig(), {TOKEN_ENV: " "})


def test_tls_needs_certificate_key_and_ca_together(tmp_path: Path):
    with pytest.raises(ValueError, match="together"):
        SecurityConfig(tls_cert_file=tmp_path / "c")
    with pytest.raises(ValueError, match="needs --tls-cert-file"):
        SecurityConfig(tls_server_name="x")
    assert SecurityConfig(tls_cert_file=tmp_path / "c", tls_key_file=tmp_path / "k", tls_ca_file=tmp_path / "a").tls


def test_the_interceptor_wants_exactly_the_bearer_token():
    interceptor = TokenInterceptor("tok")
    assert interceptor.authorized((("authorization", "Bearer tok"),))
    assert interceptor.authorized((("x", "y"), ("authorization", b"Bearer tok")))
    for metadata in (None, (), (("authorization", "Bearer to"),), (("authorization", "tok"),),
                     (("authorization", "Bearer tokk"),), (("x-token", "Bearer tok"),)):
        assert not interceptor.authorized(metadata), metadata
    assert RpcSecurity("tok").call_metadata == (("authorization", "Bearer tok"),)
    assert RpcSecurity().call_metadata == () and RpcSecurity().server_interceptors() == []


@pytest.mark.parametrize("name", REALS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_sampling_params_refuse_non_finite_reals(name: str, value: float):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("bias", [math.nan, 100.5, -1e30, math.inf])
def test_sampling_params_refuse_a_logit_bias_out_of_range(bias: float):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: bias})
    assert SamplingParams(logit_bias={3: 100.0, 4: -100.0}).logit_bias == {3: 100.0, 4: -100.0}


def test_sampling_params_refuse_negative_resumed_outputs():
    with pytest.raises(ValueError, match="num_resumed_outputs must be non-negative"):
        SamplingParams(num_resumed_outputs=-1)


@pytest.mark.parametrize("request_kwargs, message", [
    ({"request_id": ""}, "request_id"),
    ({"request_id": "x" * 2000}, "request_id"),
    ({"sampling_params": SamplingParams(n=2)}, "n=2"),
    ({"eos_token_ids": (1000,)}, "eos_token_ids: token id 1000"),
    ({"eos_token_ids": (-1,)}, "eos_token_ids: token id -1"),
    ({"eos_token_ids": (1,) * (MAX_STOP_TOKEN_IDS + 1)}, "eos_token_ids has"),
    ({"sampling_params": SamplingParams(stop_token_ids=(1,) * (MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids has"),
    ({"sampling_params": SamplingParams(logit_bias={100: 1.0})}, "logit_bias"),
    ({"cache_salt": "s" * 5000}, "cache_salt"),
    ({"prompt_token_ids": [1] * 64}, "maximum context length"),
    ({"sampling_params": SamplingParams(num_resumed_outputs=3)}, r"num_resumed_outputs \(3\) must be below"),
])
def test_the_engine_refuses_what_it_cannot_serve(request_kwargs, message):
    request = EngineCoreRequest(**{"request_id": "r", "prompt_token_ids": [1, 2, 3],
                                   "sampling_params": SamplingParams(), **request_kwargs})
    with pytest.raises(ValueError, match=message):
        check_engine_request(request, max_model_len=64, vocab_size=100)


def test_the_engine_accepts_an_ordinary_request():
    check_engine_request(EngineCoreRequest("r", [1, 2, 3], SamplingParams(stop_token_ids=(5,), logit_bias={7: -3.0}),
                                           eos_token_ids=(2,)), max_model_len=64, vocab_size=100)
