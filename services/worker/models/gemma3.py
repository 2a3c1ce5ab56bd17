"""Gemma 3's text model (`Gemma3ForCausalLM`, model_type `gemma3_text`) over a flat batch of tokens,
built from the Llama family's pieces (services/worker/models/llama.py) where they are the same:
fused q|k|v and gate|up projections, tensor-parallel slices, paged attention, the vocabulary.

    input_ids, positions: [num_tokens]
      embed_tokens * sqrt(hidden_size)
      -> num_layers x [h += post_attn_norm(attention(input_norm(h)));  h += post_ffw_norm(mlp(pre_ffw_norm(h)))]
      -> norm -> hidden_states [num_tokens, hidden_size];  compute_logits -> [num_tokens, vocab]

Where Gemma 3 differs from Llama:
  - four norms a layer (before and after attention and MLP), each Gemma's RMSNorm: x * (1 + w);
  - QK-norm: q and k normalised per head (Gemma's RMSNorm over head_size) before RoPE;
  - layers of two kinds (`layer_types`): sliding-window ones (`sliding_window` tokens) and global
    ones, each kind with its own RoPE (`rope_parameters[kind]`: theta 10,000 vs 1,000,000 and
    scaling for the global layers of the larger models);
  - scores scaled by query_pre_attn_scalar ** -0.5, not head_size ** -0.5; the final logits
    softcapped when `final_logit_softcapping` is set. The scores never are: QK-norm took the place of
    Gemma 2's softcap, and transformers' Gemma 3 ignores `attn_logit_softcapping`, as we do;
  - GELU (tanh approximation) gating in the MLP; the LM head tied to the embedding.
On the CPU's small steps the layers run as one native call (services/worker/native_decoder.py) where
every linear layer is in GGUF blocks: the same kernels as these modules, in the same order.
"""

from __future__ import annotations

import torch
from torch import nn

from services.common.hf_config import HFConfig
from services.worker.attention import Attention
from services.worker.layers.activation import GeluTanhAndMul
from services.worker.layers.rmsnorm import GemmaRMSNorm
from services.worker.layers.rotary_embedding import RotaryEmbedding, rope_parameters_of, split_and_rotate_qkv
from services.worker.layers.vocab_parallel_embedding import VocabParallelEmbedding
from services.worker.models.llama import (GatedMLP, LlamaAttention, LlamaForCausalLM, head_partition_of, head_size_of,
                                          sliding_window_of)
from services.worker.parallel_group import TensorParallelGroup

GELU_TANH = ("gelu_pytorch_tanh",)  # transformers' name of torch's GELU with the tanh approximation


def layer_types_of(config: HFConfig) -> list[str]:
    """Each layer's kind, `sliding_attention` or `full_attention` (transformers fills it in from
    the older `sliding_window_pattern` when a config lacks it)."""
    layer_types = list(config.layer_types)
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown or len(layer_types) != config.num_hidden_layers:
        raise ValueError(f"layer_types must name sliding_attention or full_attention for each of the "
                         f"{config.num_hidden_layers} layers, got {layer_types}")
    return layer_types


class Gemma3MLP(GatedMLP):
    def __init__(self, config: HFConfig, dtype: torch.dtype, tp: TensorParallelGroup) -> None:
        activation = getattr(config, "hidden_activation", None)
        if activation not in GELU_TANH:
            raise ValueError(f"unsupported hidden_activation {activation!r}; supported: {', '.join(GELU_TANH)}")
        super().__init__(config, dtype, tp, GeluTanhAndMul())


class Gemma3Attention(LlamaAttention):
    def __init__(self, config: HFConfig, layer_idx: int, dtype: torch.dtype,
                 tp: TensorParallelGroup) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer_idx, bias, bias, dtype, tp)
        # Llama's projections and heads, Gemma's own score scale (replacing head_size ** -0.5) and norms.
        self.q_norm = GemmaRMSNorm(self.head_size, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_size, config.rms_norm_eps)
        self.attn = Attention(
            layer_idx, self.num_heads, self.num_kv_heads, self.head_size, config.query_pre_attn_scalar**-0.5,
            sliding_window=sliding_window_of(config, layer_idx),
        )

    def forward(self, hidden_states: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        n = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(n, self.num_heads, self.head_size))  # [n, H, D]
        k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_size))  # [n, Hkv, D]
        # Back into one q|k|v row per token: RoPE rotates q and k together there (one native call on the CPU).
        qkv = torch.cat((q.view(n, self.q_size), k.view(n, self.kv_size), v), dim=-1)
        q, k, v = split_and_rotate_qkv(qkv, cos_sin, self.num_heads, self.num_kv_heads, self.head_size)
        out = self.attn(q.reshape(n, self.q_size), k.reshape(n, self.kv_size), v)  # [n, H * D]
        return self.o_proj(out)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: HFConfig, layer_idx: int, dtype: torch.dtype,
                 tp: TensorParallelGroup) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = Gemma3Attention(config, layer_idx, dtype, tp)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = Gemma3MLP(config, dtype, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, hidden_states: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        # The residual adds come after the post-norms, so there is no add + norm to fuse (as in Llama).
        attn = self.post_attention_layernorm(self.self_attn(self.input_layernorm(hidden_states), cos_sin))
        hidden_states = hidden_states + attn
        mlp = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden_states)))
        return hidden_states + mlp


class Gemma3Model(nn.Module):
    def __init__(self, config: HFConfig, dtype: torch.dtype, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        # sqrt(hidden_size) rounded to the model dtype, as transformers multiplies the embeddings by it.
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5, dtype=dtype), persistent=False)
        self.layer_types = layer_types_of(config)
        # One RoPE cache per kind of layer, each gathered once per step.
        self.rotary_emb = nn.ModuleDict({
            kind: RotaryEmbedding(head_size_of(config), config.max_position_embeddings,
                                  rope_parameters_of(config, kind), dtype)
            for kind in sorted(set(self.layer_types))
        })
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i, dtype, tp) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # The layers as one native call for the CPU's small steps, set by the worker where the model can
        # take it (as LlamaModel's).
        self.native_decoder = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) * self.embed_scale  # [num_tokens, hidden_size]
        cos_sin = {kind: rope(positions) for kind, rope in self.rotary_emb.items()}  # [num_tokens, head_size] each
        if self.native_decoder is not None:
            normed = self.native_decoder.forward(hidden_states, tuple(cos_sin.values()))  # rotary_emb's order
            if normed is not None:
                return normed
        for layer, kind in zip(self.layers, self.layer_types):
            hidden_states = layer(hidden_states, cos_sin[kind])
        return self.norm(hidden_states)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Weights load as the Llama family's do (`LlamaForCausalLM.load_weights`: fused projections,
    tensor-parallel slices, GGUF blocks); the norms add their 1 as they load."""

    def __init__(self, config: HFConfig, dtype: torch.dtype,
                 tp: TensorParallelGroup | None = None) -> None:
        nn.Module.__init__(self)
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention (an embedding model) cannot generate")
        tp = tp or TensorParallelGroup()
        self.config = config
        self.heads = head_partition_of(config, tp)  # this rank's; its KV cache holds these KV heads only
        self.model = Gemma3Model(config, dtype, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        self.final_logit_softcapping: float | None = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        logits = self.lm_head.logits(hidden_states, out)
        if logits is None or self.final_logit_softcapping is None:
            return logits
        cap = self.final_logit_softcapping
        return logits.div_(cap).tanh_().mul_(cap)  # tanh(logits / cap) * cap, in the same order
