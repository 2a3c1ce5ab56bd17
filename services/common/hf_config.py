"""A model's config.json with transformers' defaults filled in, read without importing transformers.

`AutoConfig` fills in what each architecture leaves out of config.json (a folder saved by
transformers holds only the values that differ from its class's defaults). But importing
transformers costs a process seconds of CPU: it scans its model packages on the first import. A
worker reads its model's config on every start, so transformers resolves a config.json once, and
the full result is kept as JSON in the cache directory, keyed by the file's bytes and the
transformers version. Later starts read that file and never import transformers.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any
import copy
import hashlib
import json
import logging
import os
import tempfile

from services.common.architectures import CONFIG_FILE
from services.common.config import default_cache_dir

logger = logging.getLogger(__name__)

CONFIGS_DIR = "configs"  # under the cache directory: one `<digest>.json` per resolved config.json


class HFConfig:
    """The resolved config's values as attributes, as `transformers.PretrainedConfig` offers them:
    a missing one raises AttributeError, so `getattr(config, name, default)` works as it does there."""

    def __init__(self, values: dict[str, Any]) -> None:
        self._values = values  # a dict parsed for this config alone: nothing else holds it

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # never `_values` itself: copy and pickle look for it before __init__
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"the model's config has no {name!r}") from None

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._values)

    def __repr__(self) -> str:
        return f"HFConfig({self._values.get('architectures')})"


def load_hf_config(model_path: Path, cache_dir: Path | None = None) -> HFConfig:
    """The config of the Hugging Face folder `model_path`, as `AutoConfig.from_pretrained` resolves it.
    transformers' errors for a missing or malformed config.json reach the caller as they are."""
    config_file = Path(model_path) / CONFIG_FILE
    try:
        raw = config_file.read_bytes()
    except OSError:
        return HFConfig(_resolve(model_path))  # transformers says what is wrong with the folder
    cached = Path(cache_dir or default_cache_dir()) / CONFIGS_DIR / f"{_digest(raw)}.json"
    try:
        values = json.loads(cached.read_text())
        if isinstance(values, dict):
            return HFConfig(values)
    except (OSError, ValueError):
        pass  # not resolved yet, or a damaged entry: resolve again and replace it
    values = _resolve(model_path)
    _store(cached, values)
    return HFConfig(values)


def _digest(config_json: bytes) -> str:
    # transformers' version is part of the key: another release may fill in other defaults.
    version = metadata.version("transformers").encode()
    return hashlib.sha256(version + b"\0" + config_json).hexdigest()


def _resolve(model_path: Path) -> dict[str, Any]:
    from transformers import AutoConfig  # only on a cache miss: the import is the cost this module avoids

    return json.loads(AutoConfig.from_pretrained(model_path).to_json_string(use_diff=False))


def _store(path: Path, values: dict[str, Any]) -> None:
    # A temporary sibling renamed into place: tensor-parallel ranks starting together may all write.
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(values, f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache only costs the next start the import
        logger.warning("could not cache the resolved model config in %s: %s", path.parent, exc)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
