"""Linear layers split the Megatron way across a tensor-parallel group (issue 13), and the reading
of their slices from a checkpoint.

    MergedLinear       column-parallel: several checkpoint projections (q|k|v, gate|up) stacked along
                       the output dim, of each only the rows this rank computes. No communication.
    RowParallelLinear  the input dim split to match (o_proj after attention, down_proj after the MLP):
                       each rank's matmul is a partial sum, one all-reduce completes it.

With a group of one both are plain nn.Linear layers over whole projections: no collective, no copy.

Weights arrive as a `WeightSource`: a torch tensor, or a safetensors slice (`safe_open(...).get_slice`)
that reads from the file only the rows or columns asked for, so a rank never holds a whole tensor.
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeAlias

import torch
from torch import nn
import torch.nn.functional as F

from services.worker.parallel_group import TensorParallelGroup

WeightSource: TypeAlias = Any  # torch.Tensor or safetensors' slice: both index as `source[a:b]`, `source[:, a:b]`


def shape_of(source: WeightSource) -> tuple[int, ...]:
    return tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())


def copy_checked(target: torch.Tensor, source: WeightSource, name: str, full_shape: tuple[int, ...],
                 read: slice | tuple[slice, slice] = slice(None)) -> None:
    """Copy `source[read]` into `target` after checking the checkpoint tensor's whole shape."""
    if shape_of(source) != full_shape:
        raise ValueError(f"checkpoint tensor {name} has shape {shape_of(source)}, the model expects {full_shape}")
    target.copy_(source[read])


class ShardRows(NamedTuple):
    """The rows of one checkpoint projection that this rank computes: [start, start + size) of `total`."""

    start: int
    size: int
    total: int

    @classmethod
    def whole(cls, size: int) -> ShardRows:
        return cls(0, size, size)


class MergedLinear(nn.Linear):
    """Column-parallel. `shards` names the stacked projections in output order with the rows of each
    that this rank holds; `shard_offsets[name]` is the (start, size) of that projection's rows in
    `weight` (and `bias`)."""

    def __init__(self, in_features: int, shards: dict[str, ShardRows], bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, sum(s.size for s in shards.values()), bias=bias, dtype=dtype)
        self.shards = shards
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, rows in shards.items():
            self.shard_offsets[name] = (start, rows.size)
            start += rows.size

    def load_shard(self, param: nn.Parameter, shard: str, source: WeightSource, name: str) -> None:
        start, size = self.shard_offsets[shard]
        rows = self.shards[shard]
        copy_checked(param.data[start : start + size], source, name, (rows.total, *param.shape[1:]),
                     slice(rows.start, rows.start + rows.size))


class RowParallelLinear(nn.Linear):
    """This rank's columns [col_start, col_start + in_features) of a [out, in_total] projection; the
    bias (whole on every rank) is added once, after the all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 tp: TensorParallelGroup, col_start: int = 0, in_total: int | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, dtype=dtype)
        self.tp = tp
        self.col_start = col_start
        self.in_total = in_features if in_total is None else in_total

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(F.linear(x, self.weight))  # [n, out] partial sums -> sums
        return out if self.bias is None else out + self.bias

    def load_param(self, param: nn.Parameter, source: WeightSource, name: str) -> None:
        if param is self.bias:
            copy_checked(param.data, source, name, tuple(param.shape))
        else:
            cols = slice(self.col_start, self.col_start + self.in_features)
            copy_checked(param.data, source, name, (self.out_features, self.in_total), (slice(None), cols))
