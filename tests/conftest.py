from __future__ import annotations

from pathlib import Path

import pytest

from services.worker.loader import resolve_model


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The default model (SmolLM2-135M-Instruct) as a Hugging Face folder, converted from its GGUF
    once into the default cache dir (about half a minute the first time, then instant)."""
    return resolve_model("smollm2", None)
