"""LoRA layers around the base linear layers (services/worker/layers/linear.py): the base matmul, then
each request segment's adapter delta (x A^T) B^T from the slot it runs with, by the batched kernels of
kvmesh_kernels/lora.py (one shrink and one expand per slice for the whole step). Weights sit in fixed
slots, zero-padded to max_lora_rank R:

    a_stack [max_loras, k * R, in]      the k merged slices' A (q|k|v, gate|up; k = 1 otherwise) along R,
                                        so one shrink serves them all
    b_stacks[i] [max_loras, n_i, R]     slice i's B, scaling folded in, expanded at its column offset
                                        (on the CPU stored as R rows of n_i: `_b_stack`)

Tensor parallel (vLLM's way): a column-parallel layer keeps A whole and holds its rows of B, as of its
base weight; a row-parallel layer holds its columns of A and B whole, and adds its partial delta to
its partial output before the one all-reduce.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from kvmesh_kernels.lora import lora_expand_, lora_shrink
from services.worker.forward_context import get_forward_context
from services.worker.layers.linear import MergedLinear, RowParallelLinear

# The checkpoint module each merged slice is: our shard name -> PEFT's module name.
QKV_SLICES = {"q": "q_proj", "k": "k_proj", "v": "v_proj"}
GATE_UP_SLICES = {"gate": "gate_proj", "up": "up_proj"}


class SlotShape(NamedTuple):
    """What every LoRA layer's slots are: how many, their rank, dtype and device. The dtype is the
    model's (a base weight kept in GGUF blocks has none of its own), or bfloat16 under float32
    activations on the CPU (`--dtype auto`: the kernels widen it as they load)."""

    max_loras: int
    max_rank: int
    dtype: torch.dtype
    device: torch.device


def _b_stack(max_loras: int, n: int, rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros [max_loras, n, rank]. On the CPU stored transposed, R rows of n per slot (a view): the
    native expand reads those rows in place, each load serving every row of the slot's segment;
    Triton takes the row-major layout."""
    if device.type == "cpu":
        return torch.zeros(max_loras, rank, n, dtype=dtype, device=device).transpose(1, 2)
    return torch.zeros(max_loras, n, rank, dtype=dtype, device=device)


class LoRALayer(nn.Module):
    def __init__(self, base: nn.Module, modules: list[str], out_sizes: list[int], slots: SlotShape) -> None:
        super().__init__()
        self.base = base
        self.modules_ = modules  # PEFT's module name of each slice, in output order
        self.max_rank = max_rank = slots.max_rank
        max_loras, in_features, dtype, device = slots.max_loras, base.in_features, slots.dtype, slots.device
        self.register_buffer("a_stack", torch.zeros(max_loras, len(modules) * max_rank, in_features,
                                                    dtype=dtype, device=device), persistent=False)
        self.b_stacks = [_b_stack(max_loras, n, max_rank, dtype, device) for n in out_sizes]
        offsets, start = [], 0
        for n in out_sizes:
            offsets.append(start)
            start += n
        self.offsets = offsets

    def fill(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` takes an adapter's (A, B) by PEFT module name (a module it lacks: zeros)."""
        r = self.max_rank
        self.a_stack[slot].zero_()
        for i, module in enumerate(self.modules_):
            self.b_stacks[i][slot].zero_()
            if module not in weights:
                continue
            a, b = self.shard(i, *weights[module])
            rank = a.shape[0]
            self.a_stack[slot, i * r : i * r + rank].copy_(a)
            self.b_stacks[i][slot, :, :rank].copy_(b)

    def shard(self, i: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def add_delta_(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out += each segment's LoRA delta, for the step's mapping (none: nothing to add)."""
        lora = get_forward_context().lora
        if lora is None:
            return
        y = lora_shrink(x, self.a_stack, lora.seg_indptr, lora.seg_slots)  # [T, k * R] float32
        r = self.max_rank
        for i, b_stack in enumerate(self.b_stacks):
            lora_expand_(out, y[:, i * r : (i + 1) * r], b_stack, lora.seg_indptr, lora.seg_slots, self.offsets[i])


class ColumnLoRA(LoRALayer):
    """Around a MergedLinear (qkv_proj, gate_up_proj): A whole, B of this rank's rows of each slice."""

    def __init__(self, base: MergedLinear, slices: dict[str, str], slots: SlotShape) -> None:
        self.rows = [base.shards[shard] for shard in slices]
        super().__init__(base, list(slices.values()), [rows.size for rows in self.rows], slots)

    def shard(self, i: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.rows[i]
        return a, b[rows.start : rows.start + rows.size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        self.add_delta_(out, x)
        return out


class RowLoRA(LoRALayer):
    """Around a RowParallelLinear (o_proj, down_proj): this rank's columns of A, B whole; the delta
    joins the partial sums before the all-reduce, the bias after it."""

    def __init__(self, base: RowParallelLinear, module: str, slots: SlotShape) -> None:
        super().__init__(base, [module], [base.out_features], slots)

    def shard(self, i: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.base.col_start
        return a[:, start : start + self.base.in_features], b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        if base.tp.size == 1:
            out = base.linear(x, base.bias)
            self.add_delta_(out, x)
            return out
        out = base.linear(x)  # [n, out] partial sums
        self.add_delta_(out, x)
        out = base.tp.all_reduce(out)
        return out if base.bias is None else out + base.bias


def wrap_layers(model: nn.Module, slots: SlotShape) -> list[dict[str, LoRALayer]]:
    """Put LoRA layers around every decoder layer's projections of `model` (Llama family, Gemma 3);
    returns, per decoder layer, its LoRA layers by PEFT module name (a merged layer under each of its
    slices' names)."""
    layers = []
    for decoder_layer in model.model.layers:
        attn, mlp = decoder_layer.self_attn, decoder_layer.mlp
        attn.qkv_proj = ColumnLoRA(attn.qkv_proj, QKV_SLICES, slots)
        attn.o_proj = RowLoRA(attn.o_proj, "o_proj", slots)
        mlp.gate_up_proj = ColumnLoRA(mlp.gate_up_proj, GATE_UP_SLICES, slots)
        mlp.down_proj = RowLoRA(mlp.down_proj, "down_proj", slots)
        by_module = {name: attn.qkv_proj for name in QKV_SLICES.values()}
        by_module |= {name: mlp.gate_up_proj for name in GATE_UP_SLICES.values()}
        layers.append(by_module | {"o_proj": attn.o_proj, "down_proj": mlp.down_proj})
    return layers
