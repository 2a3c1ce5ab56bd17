"""Fixtures shared by the service tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.processor.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """The services run on asyncio; module scope lets module-scoped async fixtures use it."""
    return "asyncio"


@pytest.fixture(scope="module")
def tokenizer(model_path: Path):
    return load_tokenizer(model_path)
