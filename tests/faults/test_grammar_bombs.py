"""Constraints built to cost the server, sent to `kvmesh serve` as a client would:

- a huge choice list that the operator's bounds allow is validated off the gateway's event loop
  (in linear time, and refused by llguidance's own limits): /health answers at once all along;
- a choice list, schema nesting, regex or grammar over its bound is a 400 `limit_exceeded` naming
  the field and the bound's flag, answered at once, before anything parses or compiles it;
- the processor refuses the same when called directly (gRPC INVALID_ARGUMENT), and serves on.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Iterator

import pytest

from services.common.clients import GenerateRequest
from services.common.sampling_params import SamplingParams
from services.common.structured_outputs import StructuredOutputs
from services.processor.client import GrpcProcessorClient
from tests.services.procs import Serve, serving

pytestmark = pytest.mark.slow

HEALTH_BOUND = 1.5  # seconds /health may take while a bomb is validated (it used to take 35 s)
MAX_CHOICES = 200_000  # this stack's --max-constraint-choices: the 150k bomb is allowed, 250k is not


@pytest.fixture(scope="module")
def serve(served_model: str) -> Iterator[Serve]:
    yield from serving(served_model, extra_args=["--max-constraint-bytes", str(6 * 2**20),
                                               "--max-constraint-choices", str(MAX_CHOICES)])


def _post(port: int, body: dict, timeout: float = 120) -> tuple[int, dict, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    start = time.monotonic()
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    answer = json.loads(response.read() or b"{}")
    conn.close()
    return response.status, answer, time.monotonic() - start


def _completion(**constraint) -> dict:
    return {"prompt": "Pick one:", "max_tokens": 2, **constraint}


def test_a_choice_bomb_is_validated_off_the_event_loop(serve: Serve):
    bomb = _completion(guided_choice=[f"choice number {i}" for i in range(150_000)])  # 3.5 MB
    answers: list[tuple[int, dict, float]] = []
    sender = threading.Thread(target=lambda: answers.append(_post(serve.port, bomb)))
    sender.start()
    health = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=30)
    waits: list[float] = []
    for _ in range(600):  # bounded: 60 s of polls at most
        start = time.monotonic()
        health.request("GET", "/health")
        assert health.getresponse().read() == b""
        waits.append(time.monotonic() - start)
        if not sender.is_alive():
            break
        time.sleep(0.1)
    sender.join(60)
    [(status, answer, seconds)] = answers
    assert status == 400 and answer["error"]["param"] == "guided_choice", answer
    assert "too big" in answer["error"]["message"], answer  # llguidance's own limit ended the validation
    assert len(waits) > 1 and max(waits) < HEALTH_BOUND, f"/health took {max(waits):.1f}s during a {seconds:.1f}s bomb"


@pytest.mark.parametrize("constraint, field, flag", [
    ({"guided_choice": [f"c{i}" for i in range(MAX_CHOICES + 1)]}, "guided_choice", "--max-constraint-choices"),
    ({"guided_json": "[" * 50_000 + "]" * 50_000}, "guided_json", "--max-constraint-depth"),
    ({"structured_outputs": {"json": {"type": "array", "items": json.loads('{"items":' * 100 + "{}" + "}" * 100)}}},
     "structured_outputs", "--max-constraint-depth"),
    ({"guided_regex": "(a|b)" * 1000}, "guided_regex", "--max-regex-length"),
    ({"guided_grammar": "\n".join(["start: r0", *(f'r{i}: "x" r{i + 1}' for i in range(2000)), 'r2000: "y"'])},
     "guided_grammar", "--max-grammar-rules"),
])
def test_a_constraint_over_a_bound_is_a_400_naming_it(serve: Serve, constraint: dict, field: str, flag: str):
    status, answer, seconds = _post(serve.port, _completion(**constraint))
    error = answer["error"]
    assert status == 400 and error["param"] == field and error["code"] == "limit_exceeded", answer
    assert flag in error["message"] and "over this server's limit" in error["message"], error
    assert seconds < 5.0  # refused before anything parsed or compiled it


def test_the_processor_refuses_a_bomb_itself(serve: Serve):
    bombs = [StructuredOutputs("choice", json.dumps([f"c{i}" for i in range(MAX_CHOICES + 1)])),
             StructuredOutputs("json", "[" * 50_000 + "]" * 50_000)]

    async def send() -> list[str]:
        client = GrpcProcessorClient(serve.services["processor"]["address"], timeout=30,
                                     security=serve.credential("gateway"))
        errors = []
        try:
            for i, bomb in enumerate(bombs):
                request = GenerateRequest(request_id=f"bomb-{i}", prompt="Pick one:",
                                          params=SamplingParams(max_tokens=2, structured_outputs=bomb))
                with pytest.raises(ValueError) as refused:  # INVALID_ARGUMENT
                    async for _ in client.generate(request):
                        pass
                errors.append(str(refused.value))
        finally:
            await client.close()
        return errors

    choices, depth = asyncio.run(send())
    assert "--max-constraint-choices" in choices and "--max-constraint-depth" in depth, (choices, depth)
    status, answer, _ = _post(serve.port, _completion(guided_choice=["yes", "no"], temperature=0))
    assert status == 200 and answer["choices"][0]["text"] in ("yes", "no"), answer
    serve.wait_until_engine_idle()
