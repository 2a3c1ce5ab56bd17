"""Schemathesis over the gateway's own OpenAPI schema, against the real processes on loopback (a
gateway of this module's own, with an API key, in front of the processor, engine and worker of the
session's shared stack): valid and invalid bodies for every operation, each answer checked against
the schema (status codes declared, bodies conforming, invalid data refused) and never a 5xx.
Afterwards the engine holds no request and no KV block.

Bounded: a few examples per operation, derandomized, and the gateway's --max-tokens-limit keeps
each generation to a few tokens (a request over it is a 400, one that leaves max_tokens open gets it).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.config import SchemathesisConfig
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.services.procs import PYTHON, Serve, ServiceProcess, free_port, running_service

pytestmark = pytest.mark.services

API_KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GATEWAY_LIMITS = ["--max-tokens-limit", "4", "--max-n", "2", "--max-prompts", "2"]
MAX_EXAMPLES = 40  # per operation and mode (valid, invalid data): about 30 s on 2 cores


@pytest.fixture(scope="module")
def gateway(serve: Serve) -> Iterator[ServiceProcess]:
    port = free_port()
    with running_service([PYTHON, "-m", "services.cli", "gateway", "--processor-address",
                          serve.services["processor"]["address"], "--served-model-name", "smollm2",
                          "--api-key", API_KEY, "--no-access-log", *GATEWAY_LIMITS, "--port", str(port),
                          "--internal-token-file", str(serve.token_file)],
                         port, health="http") as gateway:
        yield gateway


def test_every_operation_answers_without_a_5xx_and_as_declared(gateway: ServiceProcess):
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


def test_after_fuzzing_the_engine_holds_nothing(serve: Serve, gateway: ServiceProcess):
    serve.wait_until_engine_idle()
