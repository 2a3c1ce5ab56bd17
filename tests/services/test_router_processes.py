"""Routing through the real processes: two engine+worker pairs and a processor started with
`--engine-address` twice (no --prefix-index: it asks the engines, Engine.MatchPrefix over gRPC). A
prompt sharing a cached prefix goes to the engine holding it, which reports the predicted cached tokens;
the processor's /metrics shows the decisions and no misprediction."""

from __future__ import annotations

import re
import urllib.request
from contextlib import ExitStack

import anyio

from services.common.clients import GenerateRequest
from services.common.sampling_params import SamplingParams
from services.processor.client import GrpcProcessorClient
from tests.services.procs import free_port, running_kvmesh, running_stack

KV_BYTES = 32 * 2**20
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 8


def metric(page: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    total = 0.0
    for line in page.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


def test_a_processor_over_two_engines_follows_the_prefix(served_model: str):
    with ExitStack() as exits:
        engines = [exits.enter_context(running_stack(worker=dict(model=served_model, dtype="float32",
                                                                 kv_cache_memory=KV_BYTES), engine={})).engine
                   for _ in range(2)]
        metrics_port = free_port()
        processor = exits.enter_context(running_kvmesh("processor", model=served_model, metrics_port=metrics_port,
                                                       engine_address=[e.address for e in engines]))

        async def ask(request_id: str, question: str) -> int:
            client = GrpcProcessorClient(processor.address, timeout=30)
            try:
                request = GenerateRequest(request_id, SamplingParams(temperature=0, max_tokens=2),
                                          prompt=SYSTEM + question)
                return [d async for d in client.generate(request)][0].num_cached_tokens
            finally:
                await client.close()

        assert anyio.run(ask, "r-0", "What is two plus two? Explain it step by step.") == 0
        cached = anyio.run(ask, "r-1", "Name a colour of the rainbow and say why you like it.")
        assert cached >= 5 * 16, processor.log()  # the system prompt's whole blocks, on the engine holding them
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
            page = response.read().decode()
        assert metric(page, "kvmesh_router_decisions_total", policy="kv-aware", reason="no_hit") == 1
        assert metric(page, "kvmesh_router_decisions_total", policy="kv-aware", reason="prefix_hit") == 1
        assert metric(page, "kvmesh_router_decisions_total", reason="index_down") == 0
        assert metric(page, "kvmesh_router_prediction_error_tokens_count") == 2
        assert metric(page, "kvmesh_router_prediction_error_tokens_bucket", le="-1.0") == 0
        assert metric(page, "kvmesh_router_prediction_error_tokens_bucket", le="0.0") == 2
        assert metric(page, "kvmesh_router_mispredictions_total") == 0
