"""The pieces of internal security that need no server: where the tokens come from, the
interceptor's comparison, which role may call which method, the refusal counter, and the checks a
request meets before the engine queues it."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from services.common.config import SecurityConfig
from services.common.engine_output import EngineCoreRequest
from services.common.rpc.kvmesh.v1 import engine_pb2, processor_pb2, worker_pb2
from services.common.rpc.security import (
    ANY,
    ENGINE,
    GATEWAY,
    METHOD_CALLERS,
    PROCESSOR,
    ROLES,
    STEP_CHANNEL_METHOD,
    TOKEN_ENV,
    Refusals,
    RpcSecurity,
    TokenInterceptor,
    callers_of,
    read_token,
)
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
    interceptor = TokenInterceptor([("tok", ANY)])
    assert interceptor.role_of((("authorization", "Bearer tok"),)) == ANY
    assert interceptor.role_of((("x", "y"), ("authorization", b"Bearer tok"))) == ANY
    for metadata in (None, (), (("authorization", "Bearer to"),), (("authorization", "tok"),),
                     (("authorization", "Bearer tokk"),), (("x-token", "Bearer tok"),), (("authorization", ""),)):
        assert interceptor.role_of(metadata) is None, metadata
    assert RpcSecurity("tok").call_metadata == (("authorization", "Bearer tok"),)
    assert RpcSecurity().call_metadata == () and RpcSecurity().server_interceptors() == []


def test_the_interceptor_names_the_role_of_each_token():
    interceptor = TokenInterceptor([("g", GATEWAY), ("p", PROCESSOR), ("e", ENGINE), ("shared", ANY)])
    for token, role in (("g", GATEWAY), ("p", PROCESSOR), ("e", ENGINE), ("shared", ANY), ("x", None)):
        assert interceptor.role_of((("authorization", f"Bearer {token}"),)) == role


SERVICES = [processor_pb2.DESCRIPTOR.services_by_name["Processor"], engine_pb2.DESCRIPTOR.services_by_name["Engine"],
            worker_pb2.DESCRIPTOR.services_by_name["Worker"]]


def test_every_method_has_exactly_the_callers_it_needs():
    """Each method of each kvmesh service, by the roles that may call it: a new method fails here
    until someone decides who calls it."""
    callers = {f"/{s.full_name}/{m.name}": callers_of(f"/{s.full_name}/{m.name}") - {ANY}
               for s in SERVICES for m in s.methods}
    gateway, processor, engine = {GATEWAY}, {PROCESSOR}, {ENGINE}
    assert callers == {
        "/kvmesh.v1.Processor/Generate": gateway, "/kvmesh.v1.Processor/GetModelInfo": gateway,
        "/kvmesh.v1.Processor/Tokenize": gateway, "/kvmesh.v1.Processor/Detokenize": gateway,
        "/kvmesh.v1.Processor/GetTokenizerInfo": gateway,
        "/kvmesh.v1.Processor/LoadLoRAAdapter": gateway, "/kvmesh.v1.Processor/UnloadLoRAAdapter": gateway,
        "/kvmesh.v1.Engine/LoadLoRAAdapter": processor, "/kvmesh.v1.Engine/UnloadLoRAAdapter": processor,
        "/kvmesh.v1.Engine/Generate": processor, "/kvmesh.v1.Engine/Abort": processor,
        "/kvmesh.v1.Engine/GetStats": processor, "/kvmesh.v1.Engine/MatchPrefix": processor,
        "/kvmesh.v1.Engine/GetInfo": {PROCESSOR, ENGINE},
        "/kvmesh.v1.Engine/Prefill": engine, "/kvmesh.v1.Engine/ReleaseTransfer": engine,
        "/kvmesh.v1.Engine/ProveIdentity": processor,
        "/kvmesh.v1.Worker/GetInfo": engine, "/kvmesh.v1.Worker/InitializeCache": engine,
        "/kvmesh.v1.Worker/SendKV": engine, "/kvmesh.v1.Worker/ReceiveKV": engine}
    assert set(METHOD_CALLERS) - set(callers) == {STEP_CHANNEL_METHOD}  # no entry for a method that is gone
    assert callers_of(STEP_CHANNEL_METHOD) == {ENGINE, ANY}
    assert callers_of("/kvmesh.v1.Unknown/Call") == {ANY}  # unclassified: the shared token only
    assert callers_of("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo") == {*ROLES, ANY}


def test_a_process_sends_its_own_role_token_and_accepts_the_ones_it_holds(tmp_path: Path):
    files = {}
    for role in ROLES:
        files[role] = tmp_path / role
        files[role].write_text(f"{role}-secret\n")
    config = SecurityConfig(gateway_token_file=files[GATEWAY], processor_token_file=files[PROCESSOR])
    processor = RpcSecurity.load(config, PROCESSOR)
    assert processor.token == "processor-secret"
    assert processor.call_metadata == (("authorization", "Bearer processor-secret"), ("kvmesh-role", PROCESSOR))
    assert dict(processor.accepted) == {"gateway-secret": GATEWAY, "processor-secret": PROCESSOR}
    # A role without a file of its own sends the shared token, which is accepted as every role.
    (tmp_path / "shared").write_text("shared-secret")
    shared = SecurityConfig(internal_token_file=tmp_path / "shared", processor_token_file=files[PROCESSOR])
    assert RpcSecurity.load(shared, ENGINE).call_metadata == (("authorization", "Bearer shared-secret"),)
    assert RpcSecurity.load(shared, PROCESSOR).token == "processor-secret"
    assert dict(RpcSecurity.load(shared, ENGINE).accepted) == {"shared-secret": ANY, "processor-secret": PROCESSOR}
    files[ENGINE].write_text(" \n")
    with pytest.raises(ValueError, match="is empty"):
        RpcSecurity.load(SecurityConfig(engine_token_file=files[ENGINE]), ENGINE)


def test_the_step_channel_hello_wants_an_engine_token():
    worker = RpcSecurity(callers=(("e", ENGINE), ("g", GATEWAY)))
    assert worker.authorize("e", STEP_CHANNEL_METHOD) is None
    assert worker.authorize("g", STEP_CHANNEL_METHOD) == grpc.StatusCode.PERMISSION_DENIED
    assert worker.authorize("", STEP_CHANNEL_METHOD) == grpc.StatusCode.UNAUTHENTICATED
    assert worker.refusals.count("kvmesh.v1.Worker", grpc.StatusCode.PERMISSION_DENIED) == 1
    assert RpcSecurity().authorize("", STEP_CHANNEL_METHOD) is None  # a worker without tokens is open


def test_refusals_are_counted_each_and_logged_once_a_minute(caplog):
    refusals = Refusals()
    registry = CollectorRegistry()
    refusals.register(registry)
    with caplog.at_level(logging.WARNING, logger="services.common.rpc.security"):
        for _ in range(1000):
            refusals.refuse("kvmesh.v1.Worker", grpc.StatusCode.PERMISSION_DENIED, "/kvmesh.v1.Worker/InitializeCache")
        refusals.refuse("kvmesh.v1.Engine", grpc.StatusCode.UNAUTHENTICATED, "/kvmesh.v1.Engine/Generate")
    assert len(caplog.records) == 2  # the first of each pair; the rest are counted until the next minute
    value = registry.get_sample_value
    assert value("kvmesh_rpc_refused_total", {"service": "kvmesh.v1.Worker", "reason": "PERMISSION_DENIED"}) == 1000
    assert value("kvmesh_rpc_refused_total", {"service": "kvmesh.v1.Engine", "reason": "UNAUTHENTICATED"}) == 1


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
    ({"sampling_params": SamplingParams(stop_token_ids=range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids has"),
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
