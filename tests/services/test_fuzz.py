"""Schemathesis over the gateway's own OpenAPI schema, against the real processes on loopback (a
gateway of this module's own, with an API key, in front of the processor, engine and worker of the
session's shared stack): valid and invalid bodies for every operation, each answer checked against
the schema (status codes declared, bodies conforming, invalid data refused) and never a 5xx.
Afterwards the engine holds no request and no KV block. Then hypothesis over every RPC of the
processor, engine and worker, with the caller's own credential: no message ends a service.

Bounded: a few examples per operation, derandomized, and the gateway's --max-tokens-limit keeps
each generation to a few tokens (a request over it is a 400, one that leaves max_tokens open gets it).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import schemathesis
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.config import SchemathesisConfig
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from services.common.rpc.kvmesh.v1 import engine_pb2, processor_pb2, worker_pb2
from services.common.rpc.security import ANY, callers_of
from services.common.rpc.server import GRPC_OPTIONS
from tests.services.procs import Serve, client_for, gateway_over, gone, grpc_health_status

API_KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GATEWAY_LIMITS = ["--max-tokens-limit", "4", "--max-n", "2", "--max-prompts", "2"]
MAX_EXAMPLES = 40  # per operation and mode (valid, invalid data): about 30 s on 2 cores


@pytest.fixture(scope="module")
def gateway(serve: Serve) -> Iterator[Serve]:
    with gateway_over(serve, ["--api-key", API_KEY, "--no-access-log", *GATEWAY_LIMITS]) as gateway:
        yield gateway


def test_every_operation_answers_without_a_5xx_and_as_declared(gateway: Serve):
    config = SchemathesisConfig.from_dict({"headers": AUTH})
    schema = schemathesis.openapi.from_url(f"{gateway.url}/openapi.json", headers=AUTH, config=config)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {"POST /v1/completions", "POST /v1/chat/completions"} <= {op.label for op in operations}
    for operation in operations:
        # Invalid data needs somewhere to put it: a body or query parameters.
        has_input = len(operation.body) > 0 or len(operation.query) > 0
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_input else (GenerationMode.POSITIVE,):
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None,
                      suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
            def call(case) -> None:
                # The schema cannot say everything that makes a request valid (a prompt that
                # tokenizes to nothing, penalties in range, ids in the vocabulary), so a 400 for
                # schema-valid data is fine; everything else is checked, 5xx included.
                case.call_and_validate(base_url=gateway.url, headers=AUTH, timeout=60,
                                       excluded_checks=[positive_data_acceptance])

            call()


def test_after_fuzzing_the_engine_holds_nothing(serve: Serve, gateway: Serve):
    serve.wait_until_engine_idle()


# ---------------------------------------------------------------------------------------------------
# Every RPC of every internal service, with its caller's credential: hypothesis over each method's
# request message, built from the proto's descriptor (any field, any value of its type, enums open to
# unknown numbers, strings that name nothing the service knows). No input may end a service: after
# them every process is still there and SERVING, and a normal completion works.

GRPC_SERVICES = {"processor": processor_pb2.DESCRIPTOR.services_by_name["Processor"],
                 "engine": engine_pb2.DESCRIPTOR.services_by_name["Engine"],
                 "worker": worker_pb2.DESCRIPTOR.services_by_name["Worker"]}
GRPC_EXAMPLES = 25  # per method: about 400 calls in all, a few seconds
GRPC_CALL_TIMEOUT = 2.0  # seconds; a stream still running then is cancelled (and so aborted)
MAX_DEPTH = 3  # of nested messages
WORDS = st.sampled_from(["", "abort", "stop", "bogus", "prefill", "decode", "both", "x" * 5000, "\n", "\x00"])
INTS = {FieldDescriptor.TYPE_INT32: (-2**31, 2**31 - 1), FieldDescriptor.TYPE_SINT32: (-2**31, 2**31 - 1),
        FieldDescriptor.TYPE_SFIXED32: (-2**31, 2**31 - 1), FieldDescriptor.TYPE_INT64: (-2**63, 2**63 - 1),
        FieldDescriptor.TYPE_SINT64: (-2**63, 2**63 - 1), FieldDescriptor.TYPE_SFIXED64: (-2**63, 2**63 - 1),
        FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1), FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
        FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1)}


def value_strategy(field: FieldDescriptor, depth: int) -> st.SearchStrategy:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return message_strategy(field.message_type, depth + 1)
    if field.type == FieldDescriptor.TYPE_STRING:
        return st.text(max_size=40) | WORDS
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return st.floats(width=32 if field.type == FieldDescriptor.TYPE_FLOAT else 64)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values]) | st.integers(-3, 99)
    low, high = INTS[field.type]
    return st.integers(-4, 300) | st.integers(low, high)


def message_strategy(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy:
    cls = message_factory.GetMessageClass(descriptor)
    if depth > MAX_DEPTH:
        return st.just(cls())
    optional: dict[str, st.SearchStrategy] = {}
    for field in descriptor.fields:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            optional[field.name] = st.dictionaries(value_strategy(key, depth), value_strategy(value, depth), max_size=3)
        elif field.is_repeated:
            optional[field.name] = st.lists(value_strategy(field, depth), max_size=4)
        else:
            optional[field.name] = value_strategy(field, depth)
    return st.fixed_dictionaries({}, optional=optional).map(lambda values: build(cls, values))


def build(cls: type, values: dict) -> object:
    message = cls()
    for name, value in values.items():
        target = getattr(message, name)
        if isinstance(value, dict):
            for k, v in value.items():
                if hasattr(v, "DESCRIPTOR"):
                    target[k].CopyFrom(v)
                else:
                    target[k] = v
        elif isinstance(value, list):
            target.extend(value)
        elif hasattr(value, "DESCRIPTOR"):
            target.CopyFrom(value)
        else:
            setattr(message, name, value)
    return message


def call_once(channel: grpc.Channel, path: str, method: MethodDescriptor, request, metadata) -> None:
    """One call; any status is an answer (the fuzzing checks the services, not the answers)."""
    response_cls = message_factory.GetMessageClass(method.output_type)
    kwargs = dict(request_serializer=type(request).SerializeToString, response_deserializer=response_cls.FromString)
    try:
        if method.server_streaming:
            stream = channel.unary_stream(path, **kwargs)(request, metadata=metadata, timeout=GRPC_CALL_TIMEOUT)
            for _ in stream:
                pass
        else:
            channel.unary_unary(path, **kwargs)(request, metadata=metadata, timeout=GRPC_CALL_TIMEOUT)
    except grpc.RpcError as error:
        # INTERNAL would be a failure of ours, UNKNOWN an exception no handler took.
        assert error.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (path, error.details())
        # The right credential: a refusal here would mean the fuzzing never reached the method.
        assert error.code() != grpc.StatusCode.UNAUTHENTICATED, (path, error.details())


def test_every_rpc_of_every_service_survives_any_message(serve: Serve):
    pids = dict(zip(serve.services, serve.child_pids))
    for name, service in GRPC_SERVICES.items():
        address = serve.services[name]["address"]
        for method in service.methods:
            path = f"/{service.full_name}/{method.name}"
            security = serve.credential(sorted(callers_of(path) - {ANY})[0])
            with security.channel(address, GRPC_OPTIONS) as channel:
                @given(request=message_strategy(method.input_type))
                @settings(max_examples=GRPC_EXAMPLES, derandomize=True, database=None, deadline=None,
                          suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
                def call(request) -> None:
                    call_once(channel, path, method, request, security.call_metadata)

                call()
    for name, info in serve.services.items():
        assert info["pid"] == pids[name] and not gone(info["pid"]), f"{name} went away:\n{serve.log()}"
        if name in GRPC_SERVICES:
            assert grpc_health_status(info["address"]) == health_pb2.HealthCheckResponse.SERVING, name
    client, model = client_for(serve)
    assert client.completions.create(model=model, prompt="Hello", max_tokens=2).choices[0].text
    serve.wait_until_engine_idle(timeout=30)
