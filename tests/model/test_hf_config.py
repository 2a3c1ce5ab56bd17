"""The worker's model config (services/common/hf_config.py) against transformers' `AutoConfig`: the
same values for every family, resolved once and then read from the cache without transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig

from services.common.hf_config import CONFIGS_DIR, load_hf_config
from services.worker.layers.rotary_embedding import rope_parameters_of
from tests.model.families import Family

# What the worker's model classes read, beyond config.json's own keys: the values that transformers'
# defaults fill in are the ones a plain JSON reader would get wrong. RoPE's settings, which older
# transformers kept under other names, are compared as the worker reads them (rope_parameters_of).
READ_BY_THE_WORKER = (
    "architectures", "attention_bias", "final_logit_softcapping", "head_dim", "hidden_act", "hidden_activation",
    "hidden_size", "intermediate_size", "layer_types", "max_position_embeddings", "mlp_bias", "num_attention_heads",
    "num_hidden_layers", "num_key_value_heads", "query_pre_attn_scalar", "rms_norm_eps", "rope_parameters",
    "sliding_window", "tie_word_embeddings", "use_bidirectional_attention",
    "use_sliding_window", "vocab_size",
)
MISSING = object()


def folders(model_families: dict[str, Family], model_path: Path) -> dict[str, Path]:
    return {"smollm2": model_path, **{name: family.path for name, family in model_families.items()}}


def test_every_family_reads_as_transformers_resolves_it(model_families: dict[str, Family], model_path: Path,
                                                        tmp_path: Path) -> None:
    for name, folder in folders(model_families, model_path).items():
        expected = AutoConfig.from_pretrained(folder)
        for attempt in ("resolved", "cached"):
            config = load_hf_config(folder, tmp_path)
            assert config.to_dict() == json.loads(expected.to_json_string(use_diff=False)), (name, attempt)
            for key in READ_BY_THE_WORKER:
                assert getattr(config, key, MISSING) == getattr(expected, key, MISSING), (name, attempt, key)
            # Gemma 3 rotates its kinds of layer differently; the other families, every layer alike.
            kinds = set(expected.layer_types) if expected.model_type == "gemma3_text" else {None}
            for layer_type in kinds:
                assert rope_parameters_of(config, layer_type) == rope_parameters_of(expected, layer_type), name
    assert len(list((tmp_path / CONFIGS_DIR).glob("*.json"))) == len(folders(model_families, model_path))


def test_a_cached_config_is_read_without_importing_transformers(model_path: Path, tmp_path: Path) -> None:
    load_hf_config(model_path, tmp_path)
    script = ("import sys; from pathlib import Path; from services.common.hf_config import load_hf_config; "
              f"c = load_hf_config(Path({str(model_path)!r}), Path({str(tmp_path)!r})); "
              "print(c.hidden_size, c.rms_norm_eps, any(m.startswith('transformers') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    expected = AutoConfig.from_pretrained(model_path)
    assert out == [str(expected.hidden_size), str(expected.rms_norm_eps), "False"]


def test_an_edited_config_is_resolved_again(model_families: dict[str, Family], tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    data = json.loads((model_families["llama-tied"].path / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(data))
    before = load_hf_config(folder, tmp_path / "cache").rms_norm_eps
    data["rms_norm_eps"] = before * 10
    (folder / "config.json").write_text(json.dumps(data))
    assert load_hf_config(folder, tmp_path / "cache").rms_norm_eps == before * 10


def test_a_damaged_cache_entry_is_replaced(model_path: Path, tmp_path: Path) -> None:
    load_hf_config(model_path, tmp_path)
    (entry,) = (tmp_path / CONFIGS_DIR).glob("*.json")
    entry.write_text('{"truncated": ')
    assert load_hf_config(model_path, tmp_path).hidden_size == AutoConfig.from_pretrained(model_path).hidden_size
    assert json.loads(entry.read_text())["hidden_size"] == AutoConfig.from_pretrained(model_path).hidden_size


def test_a_cache_it_cannot_write_only_costs_the_import(model_path: Path, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("a file where the cache folder should be\n")
    assert load_hf_config(model_path, not_a_folder).vocab_size == AutoConfig.from_pretrained(model_path).vocab_size
    assert "could not cache the resolved model config" in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == ["cache"]


def test_a_folder_without_a_config_is_transformers_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        load_hf_config(tmp_path, tmp_path / "cache")
