"""Which of our model classes serves a config.json `architectures` entry."""

from __future__ import annotations

from torch import nn
import transformers

from services.worker.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def get_model_class(config: transformers.PretrainedConfig) -> type[nn.Module]:
    architectures = getattr(config, "architectures", None) or []
    for architecture in architectures:
        if architecture in MODEL_CLASSES:
            return MODEL_CLASSES[architecture]
    raise ValueError(
        f"unsupported model architecture {architectures or '(none in config.json)'}; "
        f"supported: {', '.join(sorted(MODEL_CLASSES))}"
    )
