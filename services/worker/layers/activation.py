"""Gated activations over a fused gate|up projection: SiLU(gate) * up, GELU(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh_kernels import cpu_fused_ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, 2 * intermediate] = gate | up -> [num_tokens, intermediate]
        # float32 on the CPU: the native op, the one the native decoder (kvmesh_kernels/cpu_decoder.py)
        # calls, so that both paths round alike.
        if x.dtype == torch.float32 and cpu_fused_ops.usable(x):
            return cpu_fused_ops.silu_and_mul(x.contiguous())
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """GELU(gate) with the tanh approximation, times up: Gemma's MLP (`gelu_pytorch_tanh`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, 2 * intermediate] = gate | up -> [num_tokens, intermediate]
        # float32 on the CPU: the native op, as in SiluAndMul, for the same rounding as the native decoder.
        if x.dtype == torch.float32 and cpu_fused_ops.usable(x):
            return cpu_fused_ops.gelu_tanh_and_mul(x.contiguous())
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
