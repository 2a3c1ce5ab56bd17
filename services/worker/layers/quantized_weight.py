"""Weights kept in a GGUF file's blocks: the checkpoint-side source and the layer-side weight.

    GGUFBlocks   a WeightSource: one tensor's blocks as the file holds them, rows in the model's
                 order; sliced like a safetensors slice (whole rows; columns in whole blocks)
    BlockWeight  what a linear layer, the LM head or the embedding computes with instead of a float
                 weight: [rows, row_bytes] uint8 blocks and the native matmul
                 (kvmesh_kernels/cpu_quant_matmul.py), bit for bit the dequantized weights; a linear
                 layer's Q4_1 blocks are repacked for the kernel (`pack`: a vector's lanes are
                 output rows, 1.3-1.9x faster at one to four rows with AVX-512), the same bytes in another order

A layer given GGUFBlocks for all of its weight keeps them (`block_weight_of`) when they are of one
type the kernel reads; otherwise the blocks are dequantized into its float weight (`copy_checked`),
exactly as the converted Hugging Face folder holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from kvmesh_kernels import cpu_quant_matmul
from kvmesh_kernels.cpu_quant_matmul import QuantType


class GGUFBlocks:
    """Rows of one GGUF tensor in its `qtype` blocks: data [rows, row_bytes] uint8 for a logical
    [rows, cols] weight."""

    def __init__(self, ggml_type: int, data: np.ndarray, cols: int) -> None:
        if data.dtype != np.uint8 or data.ndim != 2:
            raise ValueError(f"GGUF blocks must be [rows, row_bytes] uint8, got {data.dtype} {data.shape}")
        self.ggml_type = ggml_type
        self.data = data
        self.cols = cols

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.cols

    def get_shape(self) -> list[int]:  # as a safetensors slice says it (linear.shape_of)
        return list(self.shape)

    @property
    def qtype(self) -> QuantType | None:
        """The kernel's type for these blocks, or None when it reads no such blocks."""
        try:
            qtype = QuantType(self.ggml_type)
        except ValueError:
            return None
        if qtype not in cpu_quant_matmul.FILE_TYPES:
            return None
        return qtype if self.cols % cpu_quant_matmul.block_weights(qtype) == 0 else None

    def splits_columns_at(self, *cols: int) -> bool:
        """Whether a column slice at `cols` cuts only between blocks."""
        block_size, _ = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(self.ggml_type)]
        return all(c % block_size == 0 for c in cols)

    def __getitem__(self, index: slice | tuple[slice, slice]) -> GGUFBlocks:
        rows, cols = (index, slice(None)) if isinstance(index, slice) else index
        data = self.data[rows]
        start, stop, step = cols.indices(self.cols)
        if (start, stop) != (0, self.cols):
            if step != 1 or not self.splits_columns_at(start, stop):
                raise ValueError(f"columns [{start}, {stop}) of a GGUF tensor do not fall on its block boundaries")
            block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(self.ggml_type)]
            data = data[:, start // block_size * type_size : stop // block_size * type_size]
        return GGUFBlocks(self.ggml_type, data, stop - start)

    def dequantize(self) -> torch.Tensor:
        """[rows, cols] float32: gguf's own dequantization, the one transformers converts with."""
        values = gguf.quants.dequantize(self.data, gguf.GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(self.shape)


class BlockWeight(NamedTuple):
    """A [rows, cols] weight as GGUF blocks: row n is blocks[n], or with `packed` the blocks in
    cpu_quant_matmul.pack's layout (a 1-D uint8 tensor)."""

    blocks: torch.Tensor  # [rows, row_bytes] uint8, or packed
    qtype: QuantType
    cols: int
    rows: int
    packed: bool = False
    gemm_weight: BlockWeight | None = None  # the larger steps' copy (BF16 or an I8 type): `use_gemm_dtype`

    @property
    def gemm_rows(self) -> int:
        """The rows of x from which `linear` takes `gemm_weight`, else torch's GEMM."""
        if self.gemm_weight is not None:
            return LOW_PRECISION_GEMM_ROWS[self.gemm_weight.qtype]
        return cpu_quant_matmul.gemm_rows()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, W, bias): x [..., cols] float32 -> [..., rows] float32 (into `out`, for a 2-D x,
        as cpu_quant_matmul.linear)."""
        if self.gemm_weight is not None and x.numel() >= self.gemm_rows * self.cols:
            return self.gemm_weight.linear(x, bias, out)
        return cpu_quant_matmul.linear(x, self.blocks, self.qtype, self.cols, bias, n=self.rows if self.packed else None,
                                       out=out)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """F.embedding(ids, W): the rows of `ids`, dequantized -> [len(ids), cols] float32."""
        assert not self.packed, "an embedding's blocks stay in row order"
        return cpu_quant_matmul.dequantize(self.blocks[ids], self.qtype, self.cols)

    def dequantize(self) -> torch.Tensor:
        """The whole [rows, cols] weight as float32, bit for bit gguf's dequantization."""
        if self.packed:
            return cpu_quant_matmul.dequantize_packed(self.blocks, self.rows, self.cols)
        return cpu_quant_matmul.dequantize(self.blocks, self.qtype, self.cols)


def block_weight_of(sources: Sequence[GGUFBlocks], padded_rows: int = 0, pack: bool = False) -> BlockWeight | None:
    """The sources' rows stacked in order (then `padded_rows` rows of zeros, which dequantize to 0)
    as one BlockWeight, or None where the kernel cannot take them: mixed or unread block types, or
    the kernel not built. With `pack`, blocks of a type the kernel packs are packed where that is
    faster (the AVX-512 build)."""
    qtypes = {source.qtype for source in sources}
    cols = {source.cols for source in sources}
    if len(qtypes) != 1 or None in qtypes or len(cols) != 1 or not cpu_quant_matmul.is_built():
        return None
    parts = [source.data for source in sources]
    if padded_rows:
        parts.append(np.zeros((padded_rows, parts[0].shape[1]), dtype=np.uint8))
    blocks = torch.from_numpy(np.concatenate(parts))  # a copy: the file's pages stay unpinned
    qtype, k = qtypes.pop(), cols.pop()
    if pack and qtype in cpu_quant_matmul.PACKABLE and cpu_quant_matmul.packs_faster():
        return BlockWeight(cpu_quant_matmul.pack(blocks, qtype, k), qtype, k, blocks.shape[0], packed=True)
    return BlockWeight(blocks, qtype, k, blocks.shape[0])


class BlockWeightHolder:
    """A layer's float `weight` [rows, cols] that GGUF blocks may replace: mixed into MergedLinear,
    RowParallelLinear and VocabParallelEmbedding, which call `keep_blocks` once all their weight's
    rows have arrived, and `linear` / `embedding` to compute with whichever weight they hold."""

    weight: torch.Tensor | None
    block_weight: BlockWeight | None

    def keep_blocks(self, parts: Sequence[tuple[int, GGUFBlocks]], whole: bool, padded_rows: int = 0,
                    pack: bool = False) -> None:
        """`parts`: (first row, blocks) of the weight's rows given as GGUF blocks. With `whole` (they
        are all of its rows, in order, then `padded_rows` of zeros) and a float32 weight the kernel
        can take them as, they become the weight (packed with `pack`: a weight only ever multiplied,
        never looked up by row) and the float one is dropped; otherwise each part is dequantized
        into the float weight."""
        assert self.weight is not None, "the weight's blocks were kept already"
        if whole and self.weight.dtype == torch.float32 and self.weight.device.type == "cpu":
            kept = block_weight_of([blocks for _, blocks in parts], padded_rows, pack)
            if kept is not None:
                self.block_weight = kept
                self.weight = None  # never read again: its memory goes
                return
        for start, blocks in parts:
            self.weight.data[start : start + blocks.shape[0]].copy_(blocks.dequantize())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: where a 2-D x's result goes, kept by a caller that would otherwise get large fresh pages
        every call (cpu_quant_matmul's `_output`)."""
        if self.block_weight is not None:
            return self.block_weight.linear(x, bias, out)
        if self.weight.dtype == torch.float16 and x.device.type == "cpu" and cpu_quant_matmul.is_built():
            y = cpu_quant_matmul.linear_f16(x, self.weight, bias)  # torch's float16 GEMM is slow on a CPU
        elif out is not None and bias is None and out.dtype == self.weight.dtype:
            return torch.mm(x, self.weight.t(), out=out)  # F.linear's own GEMM, written in place
        else:
            y = F.linear(x, self.weight, bias)
        return y if out is None else out.copy_(y)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        if self.block_weight is not None:
            return self.block_weight.embedding(ids)
        return F.embedding(ids, self.weight)


# From how many rows a step's matmuls take the layers' copies under `use_gemm_dtype`, by the copy's
# type. Below it the exact float32 kernel over the Q4_1 blocks runs.
#  BF16     from 24 rows: a step streams the layers' weights from memory, 66 MB of Q4_1 against 212 MB
#           of bfloat16; from 24 rows the kernel is bound by arithmetic, and the bfloat16 dot products
#           do 1.4-2x the float32 tiles' work (gate / down at 24-64 rows, 2 threads, AMD EPYC Zen 5;
#           the LM head 1.2-1.6x over its Q8_0 float32 tiles at 24-64 rows).
#  Q4_1_I8  from 2 rows: its weights are about as compact as Q4_1 (24 bytes a block against 20), its
#           integer sums 1.3-2.1x the float32 tiles' speed from one row up (AVX2, same machine); a lone
#           sequence's decode steps stay exact.
#  Q8_0_I8  from 2 rows too (the LM head: 36 bytes a block against Q8_0's 34): level with the float32
#           tiles at one row, 2.0x at two, 2.5x at eight, 1.6x at 32 (AVX2, same machine).
#  Q4_K's copy (as Q4_1_I8) and Q6_K_I8: from 2 rows, 1.9x and 1.6x the K-quant tiles there, 2.4x and
#           2.2x at 32 (Gemma 3's down projection, 640 x 2048, 2 threads, AVX2 AMD EPYC Zen 3).
# (docs/benchmarks/log.md)
LOW_PRECISION_GEMM_ROWS = {QuantType.BF16: 24, QuantType.Q4_1_I8: 2, QuantType.Q8_0_I8: 2, QuantType.Q6_K_I8: 2}


def use_gemm_dtype(layers: Sequence[BlockWeightHolder], dtype: torch.dtype) -> int:
    """Steps of `LOW_PRECISION_GEMM_ROWS` rows or more multiply these layers' block weights through a
    copy (smaller steps keep the exact float32 kernel over the blocks): for `dtype` bfloat16 the
    weights dequantized once and rounded to it (BF16); for int8, Q4_1, Q4_K, Q8_0 or Q6_K weights as
    their I8 type (cpu_quant_matmul.I8_OF), the same weights against x quantized to int8 (layers of
    other block types, or of rows not a multiple of 8, keep no copy). Returns how many layers it changed."""
    if dtype not in (torch.bfloat16, torch.int8):
        raise ValueError(f"the larger steps' copies are bfloat16 or int8, not {dtype}")
    changed = 0
    for layer in layers:
        weight = layer.block_weight
        if weight is None:
            continue
        if dtype == torch.bfloat16:
            copy = BlockWeight(cpu_quant_matmul.to_bf16_blocks(weight.dequantize()), QuantType.BF16, weight.cols,
                               weight.rows)
        elif weight.qtype in cpu_quant_matmul.I8_OF and weight.rows % cpu_quant_matmul.I8_GROUP_ROWS == 0:
            rows = cpu_quant_matmul.unpack(weight.blocks, weight.rows, weight.cols) if weight.packed else weight.blocks
            copy = BlockWeight(cpu_quant_matmul.to_i8_blocks(rows, weight.qtype, weight.cols),
                               cpu_quant_matmul.I8_OF[weight.qtype], weight.cols, weight.rows)
        else:
            continue
        layer.block_weight = weight._replace(gemm_weight=copy)
        changed += 1
    return changed
