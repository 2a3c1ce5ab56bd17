"""`kvmesh serve`'s check of a model folder's architecture, before it starts any process."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from services.common.architectures import SUPPORTED_ARCHITECTURES, check_folder_architecture
from services.worker.models.registry import MODEL_CLASSES


def folder_with(tmp_path: Path, config: object) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_the_worker_serves_exactly_the_architectures_serve_lets_through() -> None:
    assert sorted(MODEL_CLASSES) == sorted(SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
def test_a_supported_folder_passes(tmp_path: Path, architecture: str) -> None:
    check_folder_architecture(folder_with(tmp_path, {"architectures": [architecture]}))


@pytest.mark.parametrize(("config", "named"), [({"architectures": ["GPT2LMHeadModel"]}, "['GPT2LMHeadModel']"),
                                               ({"model_type": "llama"}, "(none in config.json)")])
def test_another_architecture_is_named(tmp_path: Path, config: dict, named: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(f'unsupported model architecture {named}; supported: ')}"):
        check_folder_architecture(folder_with(tmp_path, config))


def test_an_unreadable_config_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json is not a readable JSON object"):
        check_folder_architecture(folder_with(tmp_path, ["not", "an", "object"]))


def test_what_is_not_a_folder_is_left_to_the_worker(tmp_path: Path) -> None:
    # Embedded names and GGUF files are checked as they are converted; a missing path where it is located.
    for model in ("smollm2", str(tmp_path / "model.gguf"), str(tmp_path / "missing")):
        check_folder_architecture(model)
