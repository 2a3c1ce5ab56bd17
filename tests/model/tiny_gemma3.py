"""A tiny random-weight Gemma 3, saved as a Hugging Face folder at test time: windows of 16 tokens
(one KV block) on three layers of four, a global layer with its own scaled RoPE, a final-logit
softcap. Its weights are drawn wide (std 0.5, norms too), so that its greedy choices have no float
near-ties: any token that differs from transformers' is a bug, not noise. The tokenizer files are
the default model's (same vocabulary size), so `LLM` and the processor load it as any model."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from tests.model.hf_reference import HFReference

WINDOW = 16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def tiny_gemma3_config(vocab_size: int) -> Gemma3TextConfig:
    config = Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0}},
        final_logit_softcapping=30.0, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    config._attn_implementation = "eager"
    return config


def save_tiny_gemma3(folder: Path, tokenizer_folder: Path) -> HFReference:
    """Write the model (and `tokenizer_folder`'s tokenizer) to `folder`; its transformers reference."""
    torch.manual_seed(0)
    tokenizer_size = len(json_vocab(tokenizer_folder / "tokenizer.json"))
    hf_model = Gemma3ForCausalLM(tiny_gemma3_config(tokenizer_size)).eval()
    with torch.no_grad():
        for param in hf_model.parameters():
            param.normal_(0.0, 0.5)
    hf_model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_folder / name, folder / name)
    return HFReference(hf_model)


def json_vocab(tokenizer_json: Path) -> dict[str, int]:
    return Tokenizer.from_file(str(tokenizer_json)).get_vocab(with_added_tokens=True)
