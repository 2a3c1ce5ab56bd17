"""One PEFT adapter folder in host memory: per (layer, target module) its A [r, in] and its B [out, r]
with the scaling folded in, checked against the base model's config first (services/common/lora.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from services.common.lora import ADAPTER_WEIGHTS, check_adapter

_TENSOR_NAME = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])\.weight")


@dataclass(slots=True)
class AdapterWeights:
    lora_int_id: int
    rank: int
    # (layer index, checkpoint module such as "q_proj") -> (A [r, in], B [out, r] * scaling), float32
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def load(cls, lora_int_id: int, folder: str, max_lora_rank: int, base_config: dict) -> AdapterWeights:
        """ValueError naming what is wrong with the folder (services.common.lora.check_adapter)."""
        spec = check_adapter(folder, max_lora_rank, base_config)
        halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        with safe_open(Path(folder).expanduser() / ADAPTER_WEIGHTS, framework="pt", device="cpu") as f:
            for name in f.keys():
                match = _TENSOR_NAME.fullmatch(name)
                assert match is not None, f"{name} passed check_adapter"
                key = (int(match.group(1)), match.group(2))
                halves.setdefault(key, {})[match.group(3)] = f.get_tensor(name).float()
        modules = {}
        for key, pair in halves.items():
            if set(pair) != {"A", "B"}:
                raise ValueError(f"LoRA adapter {folder}: layer {key[0]} {key[1]} has lora_{''.join(pair)} only")
            modules[key] = (pair["A"], pair["B"] * spec.scaling)
        return cls(lora_int_id, spec.rank, modules)
