"""The four services as separate processes (started one by one, as pods would be), and the worker
killed mid-stream: the stream ends with an error event and [DONE], a non-streamed request gets a 5xx
OpenAI error body, /health turns 503, new requests fail fast. Nothing hangs."""

from __future__ import annotations

import json
import time

import grpc
import httpx2 as httpx
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.services.procs import grpc_health_status, running_stack

KV_BYTES = 128 * 2**20
ENDLESS = {"prompt": "Tell me a long story.", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
PROCESSOR = "kvmesh.v1.Processor"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}


def assert_5xx_openai_error(response: httpx.Response) -> None:
    assert 500 <= response.status_code < 600, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_killed_worker_fails_requests_and_health_at_once(served_model: str):
    """Also: the processor registers health and reflection, and its health follows its engine's."""
    with running_stack(worker=dict(model=served_model, dtype="float32", kv_cache_memory=KV_BYTES), engine={},
                       processor=dict(model=served_model, served_model_name="smollm2"),
                       gateway=dict(served_model_name="smollm2")) as (worker, engine, processor, gateway):

        assert grpc_health_status(processor.address, service=PROCESSOR) == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(processor.address) as channel:
            replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
            names = {s.name for reply in replies for s in reply.list_services_response.service}
        assert {PROCESSOR, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names

        with httpx.Client(base_url=gateway.url, timeout=30) as client:
            with client.stream("POST", "/v1/completions", json={**ENDLESS, "stream": True}) as response:
                assert response.status_code == 200
                events, killed = [], None
                for line in response.iter_lines():  # one iterator: a response streams once
                    if line:
                        events.append(line)
                    if len(events) == 3 and killed is None:
                        worker.kill()
                        killed = time.monotonic()
            assert time.monotonic() - killed < 10
            assert events[-1] == "data: [DONE]", events[-3:]
            error = json.loads(events[-2].removeprefix("data: "))["error"]
            assert error["message"], events[-3:]

            start = time.monotonic()
            assert_5xx_openai_error(client.post("/v1/chat/completions", json=CHAT))
            assert_5xx_openai_error(client.post("/v1/completions", json={**ENDLESS, "stream": True}))
            assert time.monotonic() - start < 5, "new requests must fail fast"

            deadline = time.monotonic() + 5
            while (health := client.get("/health")).status_code != 503:
                assert time.monotonic() < deadline, f"/health still {health.status_code}"
                time.sleep(0.2)
            assert_5xx_openai_error(health)
        # The processor follows its engine's health.
        assert grpc_health_status(processor.address, service=PROCESSOR) == health_pb2.HealthCheckResponse.NOT_SERVING
