"""A Linear layer that is several checkpoint projections stacked along the output dimension
(q|k|v, gate|up), so one matmul does the work of several."""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """`shard_sizes` names the stacked projections in output order; `shard_offsets[name]` is the
    (start, size) of that projection's rows in `weight` (and `bias`)."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias, dtype=dtype)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (start, size)
            start += size

    def load_shard(self, param: nn.Parameter, shard: str, tensor: torch.Tensor) -> None:
        start, size = self.shard_offsets[shard]
        target = param.data[start : start + size]
        if target.shape != tensor.shape:
            raise ValueError(f"shard {shard!r} expects shape {tuple(target.shape)}, checkpoint has {tuple(tensor.shape)}")
        target.copy_(tensor)
