"""The decoder stack in one native call (kvmesh_kernels/cpu/decoder.c): the CPU's small steps (decodes, short
chunks) call every layer's kernels from C instead of from ~10 Python modules per layer, bit for bit
the same kernels, arguments, thread counts and order, so the same result. Two layouts of a layer:
Llama's and Gemma 3's (`Layout`).

    ops()          the kernels' entry points (quant_matmul, fused_ops, paged_decode_attention, and
                   lora where built), as the struct the driver calls through; None until the first
                   three are built
    Weight, Layer  a layer's weights (GGUF blocks, row order or packed), LoRA slots and KV cache, as C structs
    Dims           the model's layout, sizes and the thread rule
    forward        one step: embeddings in, the final RMSNorm's output out

The caller (services/worker/native_decoder.py) builds the Layer array once and decides per step
whether the step is one this path takes.
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Sequence

import torch

from kvmesh_kernels import cpu_lora, native
from kvmesh_kernels.native import FAST_MATH

_P, _I32, _I64, _F = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
_NAME = "decoder"
_BASE_FLAGS = ("-O3", *FAST_MATH, "-ffp-contract=off")
MAX_ROPE_TABLES = 2  # Gemma 3's: one for its sliding-window layers, one for its global ones
MAX_LORA_SLICES = 3  # q|k|v
LORA_REJECTED = 1000  # decoder.c's code for segments a LoRA kernel refused


class Ops(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("matmul", "matmul_packed", "rms_norm", "add_rms_norm", "rope", "kv_write",
                                        "attention", "silu_and_mul", "gelu_tanh_and_mul", "lora_shrink",
                                        "lora_expand")]

    @property
    def has_lora(self) -> bool:
        return bool(self.lora_shrink and self.lora_expand)


class Layout(enum.IntEnum):
    """A layer's sequence of kernels (decoder.c's LAYOUT_*)."""
    LLAMA = 0
    GEMMA3 = 1


class Weight(ctypes.Structure):
    _fields_ = [("data", _P), ("bias", _P), ("row_bytes", _I64), ("rows", _I64), ("cols", _I64), ("qtype", _I32),
                ("packed", _I32)]


class Lora(ctypes.Structure):
    """A linear layer's LoRA slots (float32 or bfloat16, `dtype` as cpu_lora.DTYPES): `a` [slots, slices *
    rank, in] and each slice's B stored transposed, [slots, rank, n], at its column offset; a NULL: none."""
    _fields_ = [("a", _P), ("b", _P * MAX_LORA_SLICES), ("n", _I64 * MAX_LORA_SLICES),
                ("offset", _I64 * MAX_LORA_SLICES), ("slices", _I32), ("dtype", _I32)]


class Layer(ctypes.Structure):
    """Llama's layer leaves Gemma 3's four extra norms NULL."""
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("pre_ffw_norm", _P), ("post_ffw_norm", _P), ("q_norm", _P),
                ("k_norm", _P), ("qkv", Weight), ("o", Weight), ("gate_up", Weight), ("down", Weight),
                ("qkv_lora", Lora), ("o_lora", Lora), ("gate_up_lora", Lora), ("down_lora", Lora),
                ("k_cache", _P), ("v_cache", _P), ("sliding_window", _I32), ("rope_table", _I32)]


class Dims(ctypes.Structure):
    _fields_ = [("layout", _I32), ("hidden", _I32), ("num_heads", _I32), ("num_kv_heads", _I32), ("head_size", _I32),
                ("inter", _I32), ("block_size", _I32), ("eps", _F), ("scale", _F), ("soft_cap", _F), ("num_threads", _I32),
                ("parallel_work", _I64), ("lora_rank", _I32), ("lora_slots", _I32)]


class Step(ctypes.Structure):
    _fields_ = [("num_tokens", _I64), ("cos_sin", _P * MAX_ROPE_TABLES), ("slot_mapping", _P), ("block_table", _P),
                ("seq_lens", _P), ("seq_of_row", _P), ("max_blocks", _I32), ("seg_indptr", _P), ("seg_slots", _P),
                ("num_segs", _I64), ("prefill_bf16", _I32)]


class Scratch(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("normed", "residual", "out", "qkv", "attn", "gate_up", "act", "lora_y")]


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    fn = lib.decoder_forward
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(Ops), ctypes.POINTER(Dims), ctypes.POINTER(Layer), ctypes.c_int, _P,
                   ctypes.POINTER(Step), _P, ctypes.POINTER(Scratch)]
    return lib


_KERNEL = native.Kernel(_NAME, _BASE_FLAGS, _declare)
build, available, compile_ahead = _KERNEL.build, _KERNEL.available, _KERNEL.compile_ahead


def ops() -> Ops | None:
    """The kernels' served builds as the driver's Ops, or None when any of them (or the driver) is not
    built. The LoRA kernels are NULL where their library is not built (`Ops.has_lora`)."""
    names = ("quant_matmul", "fused_ops", "paged_decode_attention", _NAME)
    if not all(native.is_built(name) for name in names):
        return None
    qm, fo, pa = (native.library(name) for name in names[:3])
    address = lambda fn: ctypes.cast(fn, _P).value  # noqa: E731
    lora_lib = native.library("lora") if native.is_built("lora") else None
    return Ops(address(qm.quant_matmul), address(qm.quant_matmul_packed), address(fo.rms_norm),
               address(fo.add_rms_norm), address(fo.rope_inplace), address(fo.kv_write),
               address(pa.paged_decode_attention), address(fo.silu_and_mul), address(fo.gelu_tanh_and_mul),
               address(lora_lib.lora_shrink) if lora_lib else None,
               address(lora_lib.lora_expand_t) if lora_lib else None)


def lora(a_stack: torch.Tensor, b_stacks: Sequence[torch.Tensor], offsets: Sequence[int]) -> Lora:
    """A LoRA layer's slots (services/worker/lora/layers.py: float32 or bfloat16, A contiguous, each [S, n, R]
    B a view of contiguous [S, R, n] storage) as the driver's Lora."""
    if len(b_stacks) > MAX_LORA_SLICES:
        raise ValueError(f"at most {MAX_LORA_SLICES} LoRA slices in a layer, got {len(b_stacks)}")
    pad = MAX_LORA_SLICES - len(b_stacks)
    return Lora(a_stack.data_ptr(), (_P * MAX_LORA_SLICES)(*(b.data_ptr() for b in b_stacks), *(None,) * pad),
                (_I64 * MAX_LORA_SLICES)(*(b.shape[1] for b in b_stacks), *(0,) * pad),
                (_I64 * MAX_LORA_SLICES)(*offsets, *(0,) * pad), len(b_stacks), cpu_lora.DTYPES[a_stack.dtype])


def weight(block_weight, bias: torch.Tensor | None) -> Weight:
    """A layer's BlockWeight (services/worker/layers/quantized_weight.py) as the driver's Weight."""
    blocks = block_weight.blocks
    return Weight(blocks.data_ptr(), None if bias is None else bias.data_ptr(),
                  0 if block_weight.packed else blocks.shape[1], block_weight.rows, block_weight.cols,
                  int(block_weight.qtype), int(block_weight.packed))


def forward(ops_: Ops, dims: Dims, layers: ctypes.Array, final_norm: torch.Tensor, hidden: torch.Tensor,
            cos_sin: Sequence[torch.Tensor], slot_mapping: torch.Tensor, block_table: torch.Tensor,
            seq_lens: torch.Tensor, seq_of_row: torch.Tensor | None, qkv_size: int,
            lora_segments: tuple[torch.Tensor, torch.Tensor] | None = None, prefill_bf16: bool = False) -> torch.Tensor:
    """hidden: [n, hidden] float32 embeddings -> a new [n, hidden]: the final RMSNorm of the last
    layer's residual stream. cos_sin: the RoPE tables [n, head_size] that the layers' `rope_table`
    index, contiguous. The step's other tensors as the attention plan holds them (contiguous; int64
    slots, int32 tables). lora_segments: the step's (seg_indptr, seg_slots), contiguous int32, for the
    layers bound with LoRA slots; None: no request runs with an adapter. prefill_bf16: the attention
    kernel's (cpu_paged_attention.paged_decode_attention)."""
    n, h = hidden.shape
    if not 1 <= len(cos_sin) <= MAX_ROPE_TABLES or any(not t.is_contiguous() for t in cos_sin):
        raise ValueError(f"decoder_forward takes 1 to {MAX_ROPE_TABLES} contiguous RoPE tables")
    dims.num_threads = torch.get_num_threads()
    normed, residual, out = (torch.empty(n, h) for _ in range(3))
    qkv = torch.empty(n, qkv_size)
    attn = torch.empty(n, dims.num_heads * dims.head_size)
    gate_up = torch.empty(n, 2 * dims.inter)
    act = torch.empty(n, dims.inter)
    lora_y = None if lora_segments is None else torch.empty(n, MAX_LORA_SLICES * dims.lora_rank)
    scratch = Scratch(normed.data_ptr(), residual.data_ptr(), out.data_ptr(), qkv.data_ptr(), attn.data_ptr(),
                      gate_up.data_ptr(), act.data_ptr(), None if lora_y is None else lora_y.data_ptr())
    # Unused slots repeat the last table: a layer never indexes past the tables it was bound with.
    tables = (_P * MAX_ROPE_TABLES)(*(cos_sin[min(i, len(cos_sin) - 1)].data_ptr() for i in range(MAX_ROPE_TABLES)))
    seg_indptr, seg_slots = lora_segments or (None, None)
    step = Step(n, tables, slot_mapping.data_ptr(), block_table.data_ptr(), seq_lens.data_ptr(),
                None if seq_of_row is None else seq_of_row.data_ptr(), block_table.shape[1],
                None if seg_indptr is None else seg_indptr.data_ptr(),
                None if seg_slots is None else seg_slots.data_ptr(), 0 if seg_slots is None else seg_slots.shape[0],
                int(prefill_bf16))
    rc = native.library(_NAME).decoder_forward(ctypes.byref(ops_), ctypes.byref(dims), layers, len(layers),
                                               final_norm.data_ptr(), ctypes.byref(step), hidden.data_ptr(),
                                               ctypes.byref(scratch))
    if rc == LORA_REJECTED:
        raise ValueError("decoder_forward: the LoRA kernels rejected the step's adapter segments")
    if rc != 0:
        raise ValueError(f"decoder_forward: the attention kernel rejected its arguments ({rc})")
    return normed
