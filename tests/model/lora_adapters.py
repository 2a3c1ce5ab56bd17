"""PEFT LoRA adapters made at test time over a tiny family model (tests/model/families.py): random
non-zero A and B, saved as the PEFT folders vLLM serves, each with its Hugging Face + PEFT model as
the reference (tests/model/hf_reference.py)."""

from __future__ import annotations

from dataclasses import dataclass
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from services.llm import LoRARequest
from tests.model.hf_reference import HFReference

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_STD = 0.1  # A and B both random: a delta of the base's order, so adapters change the tokens


@dataclass(frozen=True)
class Adapter:
    name: str
    path: Path
    lora_int_id: int
    rank: int
    reference: HFReference  # transformers + PEFT with this adapter, float32

    @property
    def request(self) -> LoRARequest:
        return LoRARequest(self.name, self.lora_int_id, str(self.path))

    @property
    def module(self) -> str:
        """Its --lora-modules entry."""
        return f"{self.name}={self.path}"


def save_adapter(base: Path, folder: Path, name: str, lora_int_id: int, rank: int,
                 targets: tuple[str, ...] = ALL_TARGETS, use_rslora: bool = False, seed: int = 0) -> Adapter:
    """A rank-`rank` adapter of `base` (a model folder) on `targets`, lora_alpha = 2 rank, into `folder`."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), use_rslora=use_rslora,
                        init_lora_weights=False)
    with warnings.catch_warnings():  # peft asks transformers a question transformers has deprecated
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        peft_model = get_peft_model(model, config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in peft_model.named_parameters():
            if "lora_" in param_name:
                param.copy_(torch.randn(param.shape, generator=generator) * LORA_STD)
    peft_model.save_pretrained(folder)
    return Adapter(name, folder, lora_int_id, rank, HFReference(peft_model))
