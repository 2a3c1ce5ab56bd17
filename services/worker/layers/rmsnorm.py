"""RMSNorm as Llama and its family define it: normalise in float32, cast back, then scale; with a
residual, the decoder layer's residual add first (vLLM's fused add + norm). Gemma's scales by 1 + w,
in float32, before the cast (`GemmaRMSNorm`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh_kernels import cpu_fused_ops
from services.worker.layers.linear import WeightSource, copy_checked


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x: [num_tokens, hidden_size]. Without a residual: RMSNorm(x). With one: (RMSNorm(x + residual),
        # x + residual), the sum being the next residual.
        # On the CPU, one native call either way (kvmesh_kernels/cpu_fused_ops.py): torch's float32 op costs
        # ~7 us at a single token, its parallel region stalls when other processes hold the cores, and
        # the add is one more op per norm. The cast back happens before the scale, as in
        # transformers, so that low-precision models round exactly as their reference.
        if cpu_fused_ops.usable(x):
            if residual is None:
                return cpu_fused_ops.rms_norm(x.contiguous(), self.weight, self.eps)
            return cpu_fused_ops.add_rms_norm(x.contiguous(), residual.contiguous(), self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op instead of six (pow, mean, add, rsqrt, mul, mul)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), all in float32 and cast back last (transformers' order).
    The parameter holds 1 + w in float32, added once at load: checkpoints store the offset w."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32))
        self.eps = eps

    def load_param(self, param: nn.Parameter, source: WeightSource, name: str) -> None:
        copy_checked(param.data, source, name, tuple(param.shape))
        param.data += 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., hidden_size] (whole hidden states, or q / k per head) -> the same shape and dtype.
        # In float32 the cast order is moot, so the CPU takes the one native call (see RMSNorm): Gemma 3
        # has six norms a layer, ~30 us each through torch at a single token.
        if x.dtype == torch.float32 and cpu_fused_ops.usable(x):
            flat = x.reshape(-1, x.shape[-1]).contiguous()
            return cpu_fused_ops.rms_norm(flat, self.weight, self.eps).view(x.shape)
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)
