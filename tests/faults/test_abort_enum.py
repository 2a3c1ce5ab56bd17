"""An engine `Abort` naming a reason the engine does not know is refused, and nothing else happens.

What a caller holding the processor's credential sees: INVALID_ARGUMENT naming `reason` and the
reasons there are; the request it named keeps running and ends as it would have; the engine stays
SERVING under the same pid, however often it is asked (before, one such Abort of a running request
ended the engine in its metrics, and a few of them in a row made `kvmesh serve` give up).
"""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services import SamplingParams
from services.common.engine_output import EngineCoreRequest
from services.common.rpc.kvmesh.v1 import engine_pb2, engine_pb2_grpc
from services.common.rpc.server import GRPC_OPTIONS
from services.engine.client import GrpcEngineClient
from tests.services.procs import Serve, client_for, grpc_health_status

pytestmark = pytest.mark.slow

UNKNOWN_REASONS = ("bogus", "error", "length", "x" * 10_000, "abort\n")


def abort_with(serve: Serve, request_ids: list[str], reason: str) -> grpc.RpcError | None:
    security = serve.security
    with security.channel(serve.services["engine"]["address"], GRPC_OPTIONS) as channel:
        try:
            engine_pb2_grpc.EngineStub(channel).Abort(
                engine_pb2.AbortRequest(request_ids=request_ids, reason=reason),
                metadata=security.call_metadata, timeout=10)
        except grpc.RpcError as error:
            return error
    return None


def test_an_unknown_reason_is_refused_naming_the_field(serve: Serve):
    error = abort_with(serve, [], "bogus")
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "reason" in error.details() and "abort" in error.details() and "stop" in error.details()


def test_unknown_reasons_for_a_running_request_leave_it_and_the_engine_running(serve: Serve):
    engine_pid = serve.services["engine"]["pid"]
    request_id = f"abort-enum-{time.monotonic_ns()}"
    count = 24

    async def generate_while_aborting() -> list[int]:
        engine = GrpcEngineClient(serve.services["engine"]["address"], timeout=60, security=serve.security)
        request = EngineCoreRequest(request_id, [504, 3458, 282],
                                    SamplingParams(temperature=0, max_tokens=count, ignore_eos=True))
        tokens: list[int] = []
        try:
            async for output in engine.generate(request):
                tokens.extend(output.new_token_ids)
                if len(tokens) == 1:  # running in the engine now: every unknown reason, for it
                    for reason in UNKNOWN_REASONS:
                        error = await asyncio.to_thread(abort_with, serve, [request_id], reason)
                        assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, reason
                        assert error.details().startswith("reason:")
        finally:
            await engine.close()
        return tokens

    tokens = asyncio.run(generate_while_aborting())
    assert len(tokens) == count
    assert serve.services["engine"]["pid"] == engine_pid
    os.kill(engine_pid, 0)  # still there
    assert grpc_health_status(serve.services["engine"]["address"]) == health_pb2.HealthCheckResponse.SERVING
    # The reasons the engine knows still work, and the whole stack still answers.
    assert abort_with(serve, [request_id], "stop") is None
    client, model = client_for(serve)
    assert client.completions.create(model=model, prompt="Hello", max_tokens=2).choices[0].text
    serve.wait_until_engine_idle()
