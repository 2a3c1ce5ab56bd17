"""LoRA adapters as PEFT folders, without torch: how a flag names one, and what its files must hold.

    --lora-modules sql=/adapters/sql                   name=path (vLLM's short form)
    --lora-modules '{"name": "sql", "path": "/adapters/sql", "base_model_name": "llama"}'

A folder holds adapter_config.json (r, lora_alpha, target_modules, use_rslora) and
adapter_model.safetensors, whose tensors PEFT names
`base_model.model.model.layers.<N>.<self_attn|mlp>.<module>.lora_<A|B>.weight`: A is [r, in],
B is [out, r]. `check_adapter` reads the config and the safetensors header (JSON, no tensor data),
so `kvmesh serve`, the engine and the worker refuse a bad folder at start-up by the same rules.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The modules an adapter may target, by the checkpoint's names, and the sub-module holding each.
TARGET_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_TENSOR_NAME = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own bound on a header


@dataclass(frozen=True)
class LoRAModule:
    """One --lora-modules entry: the adapter's name (what requests put in `model`), its folder, and
    the served model it belongs to (None: the first --model)."""

    name: str
    path: str
    base_model_name: str | None = None

    def __str__(self) -> str:
        """The JSON form, which `parse_lora_module` reads back (how `kvmesh serve` passes it on)."""
        fields = {"name": self.name, "path": self.path}
        if self.base_model_name is not None:
            fields["base_model_name"] = self.base_model_name
        return json.dumps(fields)


def parse_lora_module(text: str) -> LoRAModule:
    """`name=path` or vLLM's JSON object with name, path and optionally base_model_name."""
    text = str(text).strip()
    if text.startswith("{"):
        try:
            fields = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--lora-modules {text!r} is not valid JSON: {exc}") from None
        unknown = set(fields) - {"name", "path", "base_model_name"} if isinstance(fields, dict) else set()
        if not isinstance(fields, dict) or unknown or not all(isinstance(fields.get(k), str) and fields[k]
                                                               for k in ("name", "path")):
            raise ValueError(f"--lora-modules {text!r}: the JSON form is an object with \"name\" and \"path\" "
                             "strings and, optionally, \"base_model_name\"")
        return LoRAModule(fields["name"], fields["path"], fields.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules {text!r} is not name=path (or its JSON form)")
    return LoRAModule(name.strip(), path.strip())


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter as a request names it (vLLM's LoRARequest): its name, a positive integer id unique
    among the adapters of one engine, and its folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a name")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id}")


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """What an adapter folder holds, checked: its rank, its scaling (lora_alpha / r, or / sqrt(r)
    with use_rslora) and the checkpoint modules it targets."""

    rank: int
    scaling: float
    target_modules: frozenset[str]


def _read_config(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter folder {folder} does not exist")
    config_file = folder / ADAPTER_CONFIG
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter folder {folder} has no {ADAPTER_CONFIG}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config_file} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} is not a JSON object")
    return config


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, from the file's JSON header (8-byte little-endian length, then JSON)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > MAX_HEADER_BYTES:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise ValueError(f"{path} is not a safetensors file: {exc}") from None
    return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def module_shapes(base_config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) of each target module of a Llama-family or Gemma 3 config.json."""
    hidden, inter = base_config["hidden_size"], base_config["intermediate_size"]
    heads = base_config["num_attention_heads"]
    kv_heads = base_config.get("num_key_value_heads") or heads
    head_dim = base_config.get("head_dim") or hidden // heads
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def check_adapter(folder: str | Path, max_lora_rank: int, base_config: dict[str, Any] | None = None) -> AdapterSpec:
    """The adapter in `folder`, or ValueError naming what is wrong: a missing folder or file, a rank
    over `max_lora_rank`, a module kvmesh cannot apply LoRA to, or (given the base model's
    config.json as `base_config`) a tensor whose shape does not fit the base model."""
    folder = Path(folder).expanduser()
    config = _read_config(folder)
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise ValueError(f"LoRA adapter folder {folder} has no {ADAPTER_WEIGHTS}")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"{folder / ADAPTER_CONFIG}: r must be a positive integer and lora_alpha a number")
    if rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {folder} has rank {rank}, over --max-lora-rank {max_lora_rank}")
    for key, wanted in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if config.get(key, wanted) != wanted:
            raise ValueError(f"LoRA adapter {folder}: {key}={config[key]!r} is not supported")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"LoRA adapter {folder}: {key} is not supported")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = sorted(t for t in targets if t not in TARGET_MODULES)
    if unknown or not targets:
        raise ValueError(f"LoRA adapter {folder} targets {', '.join(unknown) or 'no module'}; supported target "
                         f"modules: {', '.join(TARGET_MODULES)}")
    expected = module_shapes(base_config) if base_config is not None else None
    num_layers = base_config["num_hidden_layers"] if base_config is not None else None
    for name, shape in safetensors_shapes(weights).items():
        _check_tensor(folder, name, shape, rank, expected, num_layers)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return AdapterSpec(rank, float(scaling), frozenset(targets))


def _check_tensor(folder: Path, name: str, shape: tuple[int, ...], rank: int,
                  expected: dict[str, tuple[int, int]] | None, num_layers: int | None) -> None:
    match = _TENSOR_NAME.fullmatch(name)
    if match is None or TARGET_MODULES.get(match.group(3)) != match.group(2):
        raise ValueError(f"LoRA adapter {folder}: tensor {name} is not a LoRA weight of a supported target module "
                         f"({', '.join(TARGET_MODULES)})")
    layer, module, side = int(match.group(1)), match.group(3), match.group(4)
    if num_layers is not None and layer >= num_layers:
        raise ValueError(f"LoRA adapter {folder}: tensor {name} is for layer {layer}; the base model has {num_layers}")
    if expected is None:
        return
    fan_in, fan_out = expected[module]
    want = (rank, fan_in) if side == "A" else (fan_out, rank)
    if shape != want:
        raise ValueError(f"LoRA adapter {folder}: tensor {name} has shape {list(shape)}, the base model expects "
                         f"{list(want)}")


def base_config_of(model: str) -> dict[str, Any] | None:
    """The config.json of `model` when it is a Hugging Face folder (None otherwise: a GGUF model's
    shapes are checked by the worker, against the config it converts)."""
    config = Path(model).expanduser() / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    return data.get("text_config", data) if isinstance(data, dict) else None
