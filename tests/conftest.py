from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.worker.loader import resolve_model
from tests.model.hf_reference import HFReference


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
