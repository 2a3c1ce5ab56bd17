"""Linear layers split the Megatron way across a tensor-parallel group, and the reading
of their slices from a checkpoint.

    MergedLinear       column-parallel: several checkpoint projections (q|k|v, gate|up) stacked along
                       the output dim, of each only the rows this rank computes. No communication.
    RowParallelLinear  the input dim split to match (o_proj after attention, down_proj after the MLP):
                       each rank's matmul is a partial sum, one all-reduce completes it.

With a group of one both are plain nn.Linear layers over whole projections: no collective, no copy.

Weights arrive as a `WeightSource`: a torch tensor, or a safetensors slice (`safe_open(...).get_slice`)
that reads from the file only the rows or columns asked for, so a rank never holds a whole tensor, or
a GGUF file's blocks (`GGUFBlocks`), which the layers keep as they are where the native
kernel reads them (services/worker/layers/quantized_weight.py) and dequantize otherwise.
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeAlias

import torch
from torch import nn

from services.worker.layers.quantized_weight import BlockWeightHolder, GGUFBlocks
from services.worker.parallel_group import TensorParallelGroup

# torch.Tensor, safetensors' slice or GGUFBlocks: all index as `source[a:b]`, `source[:, a:b]`
WeightSource: TypeAlias = Any


def shape_of(source: WeightSource) -> tuple[int, ...]:
    return tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())


def check_shape(source: WeightSource, name: str, full_shape: tuple[int, ...]) -> None:
    if shape_of(source) != full_shape:
        raise ValueError(f"checkpoint tensor {name} has shape {shape_of(source)}, the model expects {full_shape}")


def copy_checked(target: torch.Tensor, source: WeightSource, name: str, full_shape: tuple[int, ...],
                 read: slice | tuple[slice, slice] = slice(None)) -> None:
    """Copy `source[read]` into `target` after checking the checkpoint tensor's whole shape."""
    check_shape(source, name, full_shape)
    if isinstance(source, GGUFBlocks):  # a weight kept as floats: gguf's dequantization, as transformers'
        source = source.dequantize()
    target.copy_(source[read])


class ShardRows(NamedTuple):
    """The rows of one checkpoint projection that this rank computes: [start, start + size) of `total`."""

    start: int
    size: int
    total: int

    @classmethod
    def whole(cls, size: int) -> ShardRows:
        return cls(0, size, size)


class LoadedLinear(nn.Linear):
    """An nn.Linear whose parameters are left uninitialized: every one is loaded from the checkpoint
    (load_weights raises for any that is not), and drawing them at random first was most of the
    time a worker spent building its model."""

    def reset_parameters(self) -> None:
        pass


class MergedLinear(LoadedLinear, BlockWeightHolder):
    """Column-parallel. `shards` names the stacked projections in output order with the rows of each
    that this rank holds; `shard_offsets[name]` is the (start, size) of that projection's rows in
    `weight` (and `bias`). Given GGUF blocks for every shard, it keeps them once the last shard is in."""

    def __init__(self, in_features: int, shards: dict[str, ShardRows], bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, sum(s.size for s in shards.values()), bias=bias, dtype=dtype)
        self.shards = shards
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, rows in shards.items():
            self.shard_offsets[name] = (start, rows.size)
            start += rows.size
        self.block_weight = None
        self._weight_shards: dict[str, GGUFBlocks | None] = {}  # loaded so far: their blocks, None if floats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)

    def load_shard(self, param: nn.Parameter, shard: str, source: WeightSource, name: str) -> None:
        start, size = self.shard_offsets[shard]
        rows = self.shards[shard]
        full_shape, read = (rows.total, *param.shape[1:]), slice(rows.start, rows.start + rows.size)
        if param is not self.weight or not isinstance(source, GGUFBlocks):
            copy_checked(param.data[start : start + size], source, name, full_shape, read)
            if param is self.weight:
                self._weight_shards[shard] = None
        else:
            check_shape(source, name, full_shape)
            self._weight_shards[shard] = source[read]
        if param is self.weight and len(self._weight_shards) == len(self.shards):
            blocks = [(self.shard_offsets[s][0], b) for s, b in self._weight_shards.items() if b is not None]
            blocks.sort(key=lambda part: part[0])
            self.keep_blocks(blocks, whole=len(blocks) == len(self.shards), pack=True)


class RowParallelLinear(LoadedLinear, BlockWeightHolder):
    """This rank's columns [col_start, col_start + in_features) of a [out, in_total] projection; the
    bias (whole on every rank) is added once, after the all-reduce. GGUF blocks are kept when the
    columns fall on block boundaries."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 tp: TensorParallelGroup, col_start: int = 0, in_total: int | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, dtype=dtype)
        self.tp = tp
        self.col_start = col_start
        self.in_total = in_features if in_total is None else in_total
        self.block_weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.linear(x, self.bias)
        out = self.tp.all_reduce(self.linear(x))  # [n, out] partial sums -> sums
        return out if self.bias is None else out + self.bias

    def load_param(self, param: nn.Parameter, source: WeightSource, name: str) -> None:
        if param is self.bias:
            copy_checked(param.data, source, name, tuple(param.shape))
            return
        full_shape, cols = (self.out_features, self.in_total), slice(self.col_start, self.col_start + self.in_features)
        if isinstance(source, GGUFBlocks) and source.splits_columns_at(cols.start, cols.stop):
            check_shape(source, name, full_shape)
            self.keep_blocks([(0, source[:, cols])], whole=True, pack=True)
        else:
            copy_checked(param.data, source, name, full_shape, (slice(None), cols))
