"""Loading a model's weights into our own model classes (torch). Finding the model's files, and its
tokenizer, is `services.common.model_files` (no torch).

A GGUF file is dequantized once by transformers and cached as a Hugging Face folder under the cache
directory (`model_files.cached_conversion`). Transformers only converts; the runtime model is ours
(`services.worker.models`). Where the worker keeps a GGUF model's weights in their blocks
(`--quantization`, services/worker/gguf_weights.py), the folder's floats of those weights are never read.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from services.common.hf_config import HFConfig, load_hf_config
from services.common.model_files import cached_conversion, locate_model
from services.worker.gguf_weights import GGUFWeights
from services.worker.layers.linear import WeightSource
from services.worker.models.registry import get_model_class
from services.worker.parallel_group import TensorParallelGroup

FULL_MODEL_SUFFIX = ""  # the whole model converted from a GGUF: `<stem>-<size>-<digest>`


def resolve_model(model: str, cache_dir: Path | None = None) -> Path:
    """Return a local Hugging Face folder for `model`, converting a GGUF file on first use."""
    path = locate_model(model, cache_dir)
    if path.is_file():
        return cached_conversion(path, cache_dir, FULL_MODEL_SUFFIX, "config.json", convert_gguf)
    return path


def load_model(model_path: Path, dtype: torch.dtype, device: torch.device, tp: TensorParallelGroup | None = None,
               gguf_weights: GGUFWeights | None = None, cache_dir: Path | None = None) -> tuple[nn.Module, HFConfig]:
    """Build our model for `model_path`'s config.json in `dtype` on `device` and stream its weights
    in; in a tensor-parallel group `tp`, only this rank's slices of them. With `gguf_weights` (the
    file `model_path` was converted from), the layers get its blocks where the kernel reads them.
    `cache_dir` keeps the resolved config (services.common.hf_config)."""
    config = load_hf_config(model_path, cache_dir)
    model_class = get_model_class(config)
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model folder {model_path} has no *.safetensors files")
    with torch.device(device):
        model = model_class(config, dtype, tp)
    weights = _iter_safetensors(files, device)
    model.load_weights(weights if gguf_weights is None else gguf_weights.overlay(weights))
    return model.eval(), config


def _iter_safetensors(files: list[Path], device: torch.device) -> Iterator[tuple[str, WeightSource]]:
    # One tensor at a time, as a lazy slice of the memory-mapped file: each layer reads only the
    # rows or columns its rank holds (the whole tensor at TP=1), never a full state dict.
    for file in files:
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize `gguf_path` to float32 and save it (safetensors, config, tokenizer with its chat
    template) as a Hugging Face folder in `out_dir`."""
    # `dequantize=True` is explicit on purpose: left to itself, transformers keeps the weights packed
    # in GGUF blocks whenever a Hugging Face `kernels` package is importable, and such a model
    # refuses save_pretrained.
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig  # once per file: see hf_config

    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
