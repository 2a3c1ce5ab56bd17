"""The model architectures kvmesh serves, by their config.json `architectures` name, without torch or
transformers: `kvmesh serve` refuses a folder of any other before it starts a process, and the
worker's registry (services/worker/models/registry.py) maps each of them to its model class."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("Gemma3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
CONFIG_FILE = "config.json"


def unsupported_architecture(architectures: Sequence[str]) -> str:
    """The message for a model whose config.json names `architectures`, none of them served."""
    return (f"unsupported model architecture {list(architectures) or '(none in config.json)'}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def check_folder_architecture(model: str) -> None:
    """ValueError naming the architecture when `model` is a Hugging Face folder kvmesh does not serve.
    Anything else passes: an embedded name or a GGUF file is checked as it is converted, and a
    missing path where the model is located."""
    config = Path(model).expanduser() / CONFIG_FILE
    if not config.is_file():
        return
    try:
        architectures = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"{config} is not a readable JSON object: {exc}") from None
    if not any(name in SUPPORTED_ARCHITECTURES for name in architectures):
        raise ValueError(unsupported_architecture(architectures))
