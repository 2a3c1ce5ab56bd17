"""Fixtures shared by the service tests.

`serve` is ONE `kvmesh serve` for the whole session, shared by every test that only talks to it
(test_serve, test_metrics_serve, test_openai_api, test_engine_service, test_fuzz). Its flags suit
them all: a 256-token context (so that "longer than the context" is cheap) and one running
sequence at a time under the priority policy (so that priorities decide the order of queued
requests). A test on it must leave it as it found it: every request finished, no process stopped,
counters compared as increases. Tests that stop or kill a process, or need other flags, start
their own (procs.start_serve / procs.start_service).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from services import LLM
from tests.services.procs import SERVE_KV_BYTES, SHARED_MAX_MODEL_LEN, Serve, running_serve


@pytest.fixture(scope="session")
def serve(model_path: Path) -> Iterator[Serve]:
    with running_serve(model_path, extra_args=["--max-model-len", str(SHARED_MAX_MODEL_LEN), "--max-num-seqs", "1",
                                               "--scheduling-policy", "priority"]) as serve:
        yield serve
        assert serve.proc.poll() is None, f"a test stopped the shared kvmesh serve:\n{serve.log()}"


@pytest.fixture(scope="session")
def offline(model_path: Path) -> Iterator[LLM]:
    """The in-process LLM configured as the shared `serve` (KV cache, context): the truth its
    answers are compared with."""
    llm = LLM(model=str(model_path), dtype="float32", kv_cache_memory=SERVE_KV_BYTES, max_model_len=SHARED_MAX_MODEL_LEN)
    yield llm
    del llm
    gc.collect()
