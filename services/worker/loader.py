"""Loading a model's weights into our own model classes (torch). Finding the model's files, and its
tokenizer, is `services.common.model_files` (no torch).

A GGUF file is dequantized once by transformers and cached as a Hugging Face folder under the cache
directory (`model_files.cached_conversion`); its tokenizer is the one the processor builds from the
file (`model_files.gguf_tokenizer`). Transformers only converts; the runtime model is ours
(`services.worker.models`). Where the worker keeps a GGUF model's weights in their blocks
(`--quantization`, services/worker/gguf_weights.py), the folder's floats of those weights are never read.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from services.common.gguf_file import GGUFFile
from services.common.hf_config import HFConfig, load_hf_config
from services.common.model_files import cached_conversion, gguf_tokenizer, locate_model
from services.worker.gguf_weights import GGUFWeights
from services.worker.layers.linear import WeightSource
from services.worker.models.registry import get_model_class
from services.worker.parallel_group import TensorParallelGroup

FULL_MODEL_SUFFIX = ""  # the whole model converted from a GGUF: `<stem>-<size>-<digest>`
# The tokenizer's large arrays; its scalars (bos, eos ids...) go into the config and stay.
TOKENIZER_ARRAYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                              "tokenizer.ggml.merges"})


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
    from transformers import AutoModelForCausalLM, GgufConfig  # once per file: see hf_config

    header = GGUFFile(gguf_path)
    # gguf's reader takes seconds over a large vocabulary (15 s for Gemma 3's 262,144 tokens), and
    # transformers reads the file twice to load a model, for its config and its weights. It is given
    # a copy without the tokenizer's arrays where it can take the vocabulary size from a field.
    architecture = header.field("general.architecture")
    lean = out_dir / f".lean-{gguf_path.name}"
    if _vocab_size_field_maps(architecture):
        vocab_size = header.field(f"{architecture}.vocab_size") or len(header.field("tokenizer.ggml.tokens") or ())
        header.write_without(TOKENIZER_ARRAYS, lean, {f"{architecture}.vocab_size": vocab_size})
        source = lean
    else:
        source = gguf_path
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
    finally:
        lean.unlink(missing_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    gguf_tokenizer(gguf_path).save_pretrained(out_dir)  # transformers' builders, on our reader's metadata


def _vocab_size_field_maps(architecture: str) -> bool:
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return GGUF_CONFIG_MAPPING.get(architecture, {}).get("vocab_size") == "vocab_size"
