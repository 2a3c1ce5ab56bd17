"""Rotary position embedding (RoPE), neox style (rotate halves), from a precomputed cache.

The cos/sin cache covers every position up to `max_position` and is computed once in float32, so a
step costs one gather by `positions` (shared by all layers) and, per layer, one native call on the
CPU or a few elementwise ops elsewhere.
Supported scalings: none (`default`), `linear` (positions divided by a factor) and `llama3`
(Llama 3.1's frequency-dependent interpolation).
"""

from __future__ import annotations

from typing import Any
import math

import torch
from torch import nn

from kvmesh_kernels import cpu_fused_ops
from services.common.hf_config import HFConfig

ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters_of(config: HFConfig, layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE settings as one flat dict with `rope_type` and `rope_theta`.

    transformers 5 keeps them in `config.rope_parameters` (theta included); older versions in
    `config.rope_scaling` (`type` or `rope_type`) next to `config.rope_theta`. A model whose kinds of
    layer rotate differently (Gemma 3: `sliding_attention`, `full_attention`) keeps one such dict per
    kind there; `layer_type` picks one.
    """
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if layer_type is not None:
        if layer_type not in params:
            raise ValueError(f"the config has no RoPE parameters for {layer_type} layers")
        params = dict(params[layer_type])
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] == "llama3":
        params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return params


def rope_inv_freq(head_size: int, params: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies [head_size // 2] in float32, as transformers' ROPE_INIT_FUNCTIONS compute them."""
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Wavelengths shorter than old_len / high_freq_factor keep their frequency, longer than
    # old_len / low_freq_factor are divided by `factor`, and those between are interpolated.
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, max_position: int, params: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        assert head_size % 2 == 0, "RoPE needs an even head size"
        self.head_size = head_size
        inv_freq = rope_inv_freq(head_size, params)  # [head_size // 2] float32
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, head_size] = cos | sin, cast to the model dtype once (transformers casts
        # its float32 cos/sin to the activations' dtype on every call).
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype),
                             persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        # positions: [num_tokens] -> cos | sin: [num_tokens, head_size], shared by all layers
        return self.cos_sin_cache[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_size]; rotates the pairs (i, i + head_size/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def split_and_rotate_qkv(qkv: torch.Tensor, cos_sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                         head_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection's output [n, (H + 2 Hkv) D] -> q [n, H, D], k [n, Hkv, D] rotated, and
    v [n, Hkv * D]. On the CPU q and k are rotated in place, together, by one native call (same
    rounding as `apply_rotary`); elsewhere by torch ops."""
    n = qkv.shape[0]
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    if cpu_fused_ops.usable(qkv):
        cpu_fused_ops.rope_inplace(qkv, cos_sin, num_heads + num_kv_heads, head_size)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return q.view(n, num_heads, head_size), k.view(n, num_kv_heads, head_size), v
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [n, 1, head_size // 2], broadcast over heads
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (apply_rotary(q.view(n, num_heads, head_size), cos, sin),
            apply_rotary(k.view(n, num_kv_heads, head_size), cos, sin), v)
