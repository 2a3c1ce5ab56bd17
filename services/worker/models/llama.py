"""The Llama family (Llama, Mistral, Qwen2): our own implementation over a flat batch of tokens.

    input_ids, positions: [num_tokens]  (many requests back to back; the forward context says where
                                         each one starts and which KV blocks it owns)
      embed_tokens -> num_layers x [RMSNorm -> attention -> +residual -> RMSNorm -> MLP -> +residual]
      -> RMSNorm -> hidden_states [num_tokens, hidden_size]; (each "+residual" is done by the norm
      after it: a fused add + norm, vLLM's way);  compute_logits -> [num_tokens, vocab]

Checkpoint projections are fused: q|k|v into one `qkv_proj`, gate|up into one `gate_up_proj`.
In a tensor-parallel group each rank holds a Megatron slice of every layer: its heads of
q|k|v and its rows of gate|up (column-parallel), the matching columns of o_proj and down_proj
(row-parallel, one all-reduce each), its part of the vocabulary (services/worker/layers/
vocab_parallel_embedding.py); norms and RoPE are whole on every rank. Heads are split by KV head
so that each rank keeps a whole GQA group per KV head (`HeadPartition`).
Attention itself (paged KV cache, masks, sliding windows) is `services.worker.attention.Attention`.
The three architectures differ only in a few config-driven details:
  - Qwen2 always has a bias on q, k, v (and none on o); Llama has one on all four iff `attention_bias`;
  - Mistral and Qwen2 may use a sliding window (Qwen2 per layer, through `layer_types`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn

from services.common.hf_config import HFConfig
from services.worker.attention import Attention
from services.worker.layers.activation import SiluAndMul
from services.worker.layers.linear import MergedLinear, RowParallelLinear, ShardRows, WeightSource, copy_checked
from services.worker.layers.rmsnorm import RMSNorm
from services.worker.layers.rotary_embedding import RotaryEmbedding, rope_parameters_of, split_and_rotate_qkv
from services.worker.layers.vocab_parallel_embedding import VocabParallelEmbedding
from services.worker.parallel_group import TensorParallelGroup, split_evenly

# (our fused module, the checkpoint's module, the shard it fills)
_STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)


def head_size_of(config: HFConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config: HFConfig, layer_idx: int) -> int | None:
    """The layer's attention window in tokens, or None for full attention."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window


class HeadPartition(NamedTuple):
    """The attention heads one rank computes: q heads [q_start, q_start + num_heads), KV heads
    [kv_start, kv_start + num_kv_heads).

    KV heads are cut into `size` runs as evenly as possible and each rank takes the q heads of its KV
    heads (so a rank's GQA ratio is the model's: the attention backends need no change; with 9 q and
    3 KV heads at TP=2, rank 0 has 6 q / 2 KV heads and rank 1 has 3 / 1). With fewer KV heads than
    ranks, each KV head is replicated on `size // num_kv_heads` ranks that split its q heads (vLLM's
    rule)."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadPartition:
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} attention heads do not make groups of {num_kv_heads} KV heads")
        group = num_heads // num_kv_heads
        if num_kv_heads >= size:
            kv_start, kv_count = split_evenly(num_kv_heads, size, rank)
            return cls(kv_start * group, kv_count * group, kv_start, kv_count)
        replicas = size // num_kv_heads
        if size % num_kv_heads or group < replicas:
            raise ValueError(f"{num_heads} attention heads with {num_kv_heads} KV heads cannot be split across "
                             f"{size} ranks (with fewer KV heads than ranks, the ranks must be a multiple of the KV "
                             "heads and at most the attention heads)")
        kv_start = rank // replicas
        q_offset, q_count = split_evenly(group, replicas, rank % replicas)
        return cls(kv_start * group + q_offset, q_count, kv_start, 1)


def head_partition_of(config: HFConfig, tp: TensorParallelGroup) -> HeadPartition:
    num_heads = config.num_attention_heads
    return HeadPartition.of(num_heads, getattr(config, "num_key_value_heads", None) or num_heads, tp.rank, tp.size)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up in one matmul, sharded by rows of the intermediate size."""

    def __init__(self, config: HFConfig, dtype: torch.dtype, tp: TensorParallelGroup,
                 act_fn: nn.Module, bias: bool = False) -> None:
        super().__init__()
        total = config.intermediate_size
        start, size = split_evenly(total, tp.size, tp.rank)
        rows = ShardRows(start, size, total)
        self.gate_up_proj = MergedLinear(config.hidden_size, {"gate": rows, "up": rows}, bias, dtype)
        self.act_fn = act_fn
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias, dtype, tp, start, total)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaMLP(GatedMLP):
    def __init__(self, config: HFConfig, dtype: torch.dtype, tp: TensorParallelGroup) -> None:
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; supported: silu")
        super().__init__(config, dtype, tp, SiluAndMul(), getattr(config, "mlp_bias", False))


class LlamaAttention(nn.Module):
    def __init__(self, config: HFConfig, layer_idx: int, qkv_bias: bool, o_bias: bool,
                 dtype: torch.dtype, tp: TensorParallelGroup) -> None:
        super().__init__()
        heads = head_partition_of(config, tp)
        self.num_heads = heads.num_heads  # this rank's
        self.num_kv_heads = heads.num_kv_heads
        self.head_size = d = head_size_of(config)
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        q_total = config.num_attention_heads * d
        kv_total = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * d
        kv_rows = ShardRows(heads.kv_start * d, self.kv_size, kv_total)
        self.qkv_proj = MergedLinear(
            config.hidden_size, {"q": ShardRows(heads.q_start * d, self.q_size, q_total), "k": kv_rows, "v": kv_rows},
            qkv_bias, dtype,
        )
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, o_bias, dtype, tp, heads.q_start * d, q_total)
        self.attn = Attention(
            layer_idx, self.num_heads, self.num_kv_heads, self.head_size, self.head_size**-0.5,
            sliding_window=sliding_window_of(config, layer_idx),
        )

    def forward(self, hidden_states: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        n = hidden_states.shape[0]
        q, k, v = split_and_rotate_qkv(self.qkv_proj(hidden_states), cos_sin, self.num_heads,
                                       self.num_kv_heads, self.head_size)  # [n, H, D], [n, Hkv, D], [n, Hkv * D]
        out = self.attn(q.reshape(n, self.q_size), k.reshape(n, self.kv_size), v)  # [n, H * D]
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: HFConfig, layer_idx: int, qkv_bias: bool, o_bias: bool,
                 dtype: torch.dtype, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(config, layer_idx, qkv_bias, o_bias, dtype, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, dtype, tp)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream: h = h + attn(norm(h)); h = h + mlp(norm(h)), with each add done by the
        # norm that follows it (one call on the CPU). Returns (the MLP's output, the residual so far):
        # the next layer's norm, or the final one, adds them.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, cos_sin)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: HFConfig, qkv_bias: bool, o_bias: bool,
                 dtype: torch.dtype, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        # One RoPE cache for all layers: gathered once per step, applied in each layer.
        self.rotary_emb = RotaryEmbedding(
            head_size_of(config), config.max_position_embeddings, rope_parameters_of(config), dtype
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, qkv_bias, o_bias, dtype, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # The layers as one native call for the CPU's small steps (services/worker/native_decoder.py),
        # set by the worker where the model can take it; the same kernels as the modules below.
        self.native_decoder = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        cos_sin = self.rotary_emb(positions)  # [num_tokens, head_size]
        if self.native_decoder is not None:
            normed = self.native_decoder.forward(hidden_states, (cos_sin,))
            if normed is not None:
                return normed
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, cos_sin)
        return self.norm(hidden_states, residual)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: HFConfig, dtype: torch.dtype,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallelGroup()
        self.config = config
        self.heads = head_partition_of(config, tp)  # this rank's; its KV cache holds these KV heads only
        qkv_bias, o_bias = self.attention_biases(config)
        self.model = LlamaModel(config, qkv_bias, o_bias, dtype, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens  # shared: named_parameters() lists it once, as the embedding
        else:
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, tp)

    @staticmethod
    def attention_biases(config: HFConfig) -> tuple[bool, bool]:
        """(bias on q, k, v; bias on o)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """[n, hidden_size] -> [n, vocab_size] float32 on rank 0 (the whole vocabulary gathered
        there); None on the other ranks of a tensor-parallel group, which must call it all the same.
        `out`: a buffer the caller keeps for them (VocabParallelEmbedding.logits)."""
        return self.lm_head.logits(hidden_states, out)

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into our parameters, one at a time, and
        raise if any parameter (or any shard of a fused one) was left unloaded. A sharded layer
        reads only this rank's slice of its source (a safetensors slice reads only that from the
        file)."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, str | None]] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if self.tie_word_embeddings and name.startswith("lm_head."):
                continue
            for fused, original, shard in _STACKED_PARAMS:
                if f".{original}." in name:
                    param_name = name.replace(f".{original}.", f".{fused}.")
                    module = self.get_submodule(param_name.rsplit(".", 1)[0])
                    module.load_shard(self._param(params, param_name, name), shard, tensor, name)
                    loaded.add((param_name, shard))
                    break
            else:
                param = self._param(params, name, name)
                module = self.get_submodule(name.rsplit(".", 1)[0])
                if hasattr(module, "load_param"):  # a sharded layer reads its own slice
                    module.load_param(param, tensor, name)
                else:
                    copy_checked(param.data, tensor, name, tuple(param.shape))
                loaded.add((name, None))
        missing = sorted(
            f"{name}[{shard}]" if shard else name
            for name, shard in self._expected_loads(params)
            if (name, shard) not in loaded
        )
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights: {', '.join(missing)}")

    def _param(self, params: dict[str, nn.Parameter], param_name: str, checkpoint_name: str) -> nn.Parameter:
        if param_name not in params:
            raise ValueError(f"checkpoint tensor {checkpoint_name} matches no parameter of {type(self).__name__}")
        return params[param_name]

    def _expected_loads(self, params: dict[str, nn.Parameter]) -> list[tuple[str, str | None]]:
        expected: list[tuple[str, str | None]] = []
        for name in params:
            module = self.get_submodule(name.rsplit(".", 1)[0])
            if isinstance(module, MergedLinear):
                expected.extend((name, shard) for shard in module.shard_offsets)
            else:
                expected.append((name, None))
        return expected


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with an optional sliding window (read from the config by `sliding_window_of`)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(config: HFConfig) -> tuple[bool, bool]:
        return True, False
