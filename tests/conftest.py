"""Fixtures of the whole suite, and its tiers: each test is marked with the directory it lives in
(unit, model, kernels, services, faults, deploy), so `-m` selects tiers by where a test is, never
by a mark someone had to remember. `make test-fast` runs every tier that starts no service
process, `slow` tests left out."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.processor.tokenizer import load_tokenizer
from services.worker.loader import resolve_model
from tests.model.hf_reference import HFReference

TESTS = Path(__file__).parent
TIERS = ("unit", "model", "kernels", "services", "faults", "deploy")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = item.path.relative_to(TESTS).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test lives in one of the tiers' directories {TIERS}")
        item.add_marker(tier)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """The services run on asyncio; module scope lets module-scoped async fixtures use it."""
    return "asyncio"


@pytest.fixture(scope="module")
def tokenizer(model_path: Path):
    return load_tokenizer(model_path)


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The default model (SmolLM2-135M-Instruct) as a Hugging Face folder, converted from its GGUF
    once into the default cache dir (about half a minute the first time, then instant)."""
    return resolve_model("smollm2", None)


@pytest.fixture(scope="session")
def hf_reference(model_path: Path) -> Iterator[HFReference]:
    """Hugging Face transformers' greedy generations of the default model (float32), each prompt
    generated once per session, whichever test asks first."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    yield HFReference(model)
    del model
    gc.collect()
