"""Schemathesis over the gateway's own OpenAPI schema, against the real processes on loopback (worker,
engine, processor, gateway with an API key): valid and invalid bodies for every operation, each
answer checked against the schema (status codes declared, bodies conforming, invalid data refused)
and never a 5xx. Afterwards the engine holds no request and no KV block.

Bounded: a few examples per operation, derandomized, and the gateway's --max-tokens-limit keeps
each generation to a few tokens (a request over it is a 400, one that leaves max_tokens open gets it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.config import SchemathesisConfig
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from services.engine.client import GrpcEngineClient
from tests.services.procs import PYTHON, ServiceProcess, free_port, start_service

pytestmark = pytest.mark.slow

KV_BYTES = 64 * 2**20
API_KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GATEWAY_LIMITS = ["--max-tokens-limit", "4", "--max-n", "2", "--max-prompts", "2"]
MAX_EXAMPLES = 40  # per operation and mode (valid, invalid data): about 30 s on 2 cores


@pytest.fixture(scope="module")
def stack(model_path: Path) -> Iterator[dict[str, ServiceProcess]]:
    with ExitStack() as exits:
        ports = {name: free_port() for name in ("worker", "engine", "processor", "gateway")}
        argv = {
            "worker": ["--model", str(model_path), "--kv-cache-memory", str(KV_BYTES)],
            "engine": ["--worker-address", f"127.0.0.1:{ports['worker']}"],
            "processor": ["--model", str(model_path), "--engine-address", f"127.0.0.1:{ports['engine']}"],
            "gateway": ["--processor-address", f"127.0.0.1:{ports['processor']}", "--served-model-name", "smollm2",
                        "--api-key", API_KEY, "--no-access-log", *GATEWAY_LIMITS],
        }
        services: dict[str, ServiceProcess] = {}
        for name, service_argv in argv.items():
            services[name] = start_service([PYTHON, "-m", "services.cli", name, *service_argv, "--port",
                                            str(ports[name])], ports[name],
                                           health="http" if name == "gateway" else "grpc")
            exits.callback(services[name].kill)
        yield services


def test_every_operation_answers_without_a_5xx_and_as_declared(stack):
    config = SchemathesisConfig.from_dict({"headers": AUTH})
    schema = schemathesis.openapi.from_url(f"{stack['gateway'].url}/openapi.json", headers=AUTH, config=config)
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
                case.call_and_validate(base_url=stack["gateway"].url, headers=AUTH, timeout=60,
                                       excluded_checks=[positive_data_acceptance])

            call()


def test_after_fuzzing_the_engine_holds_nothing(stack):
    async def idle() -> None:
        client = GrpcEngineClient(stack["engine"].address, timeout=5)
        try:
            deadline = time.monotonic() + 15
            while True:
                stats = await client.stats()
                if stats.num_running == stats.num_waiting == stats.num_used_blocks == 0:
                    return
                assert time.monotonic() < deadline, f"the engine still holds requests: {stats}"
                await asyncio.sleep(0.1)
        finally:
            await client.close()

    asyncio.run(idle())
