"""Which of our model classes serves a config.json `architectures` entry (the names are
services/common/architectures.py's, which `kvmesh serve` checks without torch)."""

from __future__ import annotations

from torch import nn

from services.common.architectures import SUPPORTED_ARCHITECTURES, unsupported_architecture
from services.common.hf_config import HFConfig
from services.worker.models.gemma3 import Gemma3ForCausalLM
from services.worker.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}
assert sorted(MODEL_CLASSES) == sorted(SUPPORTED_ARCHITECTURES), "serve's check and the worker must agree"


def get_model_class(config: HFConfig) -> type[nn.Module]:
    architectures = getattr(config, "architectures", None) or []
    for architecture in architectures:
        if architecture in MODEL_CLASSES:
            return MODEL_CLASSES[architecture]
    raise ValueError(unsupported_architecture(architectures))
