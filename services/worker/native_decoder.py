"""A Llama-family or Gemma 3 model's decoder stack as one native call on the CPU
(kvmesh_kernels/cpu_decoder.py) for the steps where Python's per-layer glue is a large share: fewer
tokens than the quantized matmul's GEMM threshold, so every linear layer is the native kernel's
(decodes, short chunks).

It takes such a model whose every linear layer keeps its weight in GGUF blocks (the CPU default for
a GGUF model; `--quantization int8|f16` too), with float32 norms, at tensor-parallel size 1, with the
native attention plan; any other model or step goes through the layers' modules. LoRA layers
(services/worker/lora/layers.py) around the linear layers come along: their float32 slots are bound
once, and each step passes its adapter segments, so mixed batches of adapters stay on this path. The model scales
its embeddings (Gemma 3) before the call, as before its modules. Both paths call the same
kernels in the same order, so they agree bit for bit (tests/model/test_native_decoder.py). Under
`--dtype auto` the steps from `LOW_PRECISION_GEMM_ROWS` tokens take the layers' bfloat16 or int8
copies, as the modules do.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvmesh_kernels import cpu_decoder, cpu_lora, cpu_quant_matmul
from services.worker.attention.torch_backend import NativeAttentionPlan
from services.worker.forward_context import get_forward_context
from services.worker.lora.layers import LoRALayer
from services.worker.models.gemma3 import Gemma3Model
from services.worker.models.llama import LlamaModel

LAYOUTS = {LlamaModel: cpu_decoder.Layout.LLAMA, Gemma3Model: cpu_decoder.Layout.GEMMA3}


class NativeDecoder:
    def __init__(self, model, ops: cpu_decoder.Ops) -> None:
        """`model`: a LlamaModel or Gemma3Model (services/worker/models/) that `supports` passed."""
        self.model = model
        self.layout = LAYOUTS[type(model)]
        # The RoPE tables in the order `forward` receives them: one per kind of layer (Gemma 3), or one.
        self.rope_kinds = list(model.rotary_emb.keys()) if self.layout == cpu_decoder.Layout.GEMMA3 else [None]
        self.ops = ops
        first = model.layers[0]
        attn, mlp = first.self_attn, first.mlp
        self.qkv_size = attn.q_size + 2 * attn.kv_size
        self.max_tokens = cpu_quant_matmul.gemm_rows()  # from here linear layers call torch's GEMM
        # From here the layers' low-precision copies (`--dtype auto`, quantized_weight.use_gemm_dtype), if any.
        self.low_precision_from = min(lin.block_weight.gemm_rows for lin in _linears(first))
        lora = attn.qkv_proj if isinstance(attn.qkv_proj, LoRALayer) else None
        self.dims = cpu_decoder.Dims(
            layout=self.layout, hidden=first.input_layernorm.weight.shape[0], num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads, head_size=attn.head_size, inter=_base(mlp.down_proj).in_features,
            block_size=0, eps=first.input_layernorm.eps, scale=attn.attn.scale,
            soft_cap=attn.attn.logits_soft_cap or 0.0, num_threads=torch.get_num_threads(),
            parallel_work=cpu_quant_matmul.PARALLEL_WORK, lora_rank=lora.max_rank if lora else 0,
            lora_slots=lora.a_stack.shape[0] if lora else 0)
        self._layers: dict[bool, ctypes.Array] = {}  # by low precision
        self._caches: list[torch.Tensor] | None = None

    @staticmethod
    def supports(model) -> bool:
        """Whether `model`'s layers can run natively (see the module's docstring). The kernel computes
        Llama's layer and Gemma 3's (`LAYOUTS`); a subclass may differ, so the type must be one of them."""
        if cpu_decoder.ops() is None or type(model) not in LAYOUTS:
            return False
        if type(model) is Gemma3Model and len(model.rotary_emb) > cpu_decoder.MAX_ROPE_TABLES:
            return False
        wrapped = [lin for layer in model.layers for lin in _wrapped(layer) if isinstance(lin, LoRALayer)]
        if wrapped and not (cpu_decoder.ops().has_lora and all(_lora_bindable(lin) for lin in wrapped)):
            return False
        for layer in model.layers:
            if any(lin.block_weight is None for lin in _linears(layer)):
                return False
            if _base(layer.self_attn.o_proj).tp.size != 1 or any(
                    norm.weight.dtype != torch.float32 for norm in _norms(layer)):
                return False
        return True

    def _bind(self, kv_caches: list[torch.Tensor], low_precision: bool) -> ctypes.Array:
        """The layers' structs for this list of KV caches (the worker's, fixed once allocated), over
        the exact block weights or their low-precision copies."""
        if self._caches is not kv_caches:
            self._layers, self._caches = {}, kv_caches
            self.dims.block_size = kv_caches[0].shape[2]
        if low_precision not in self._layers:
            def weight(linear) -> cpu_decoder.Weight:
                linear = _base(linear)
                exact = linear.block_weight
                block_weight = exact.gemm_weight or exact if low_precision else exact  # a layer may have no copy
                return cpu_decoder.weight(block_weight, linear.bias)

            layers = (cpu_decoder.Layer * len(self.model.layers))()
            for i, layer in enumerate(self.model.layers):
                attn, cache = layer.self_attn, kv_caches[i]
                if not cache.is_contiguous() or cache.dtype != torch.float32:
                    raise ValueError("the native decoder needs contiguous float32 KV caches")
                gemma = self._gemma3_extras(i)
                linears = _wrapped(layer)
                layers[i] = cpu_decoder.Layer(
                    layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                    *gemma.norms, *map(weight, linears), *map(_lora, linears), cache[0].data_ptr(),
                    cache[1].data_ptr(), attn.attn.sliding_window or 0, gemma.rope_table)
            self._layers[low_precision] = layers
        return self._layers[low_precision]

    def _gemma3_extras(self, i: int) -> _Gemma3Extras:
        """Layer i's pointers to Gemma 3's extra norms (NULL for Llama) and its RoPE table's index."""
        if self.layout != cpu_decoder.Layout.GEMMA3:
            return _Gemma3Extras((None,) * 4, 0)
        layer = self.model.layers[i]
        norms = (layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm, layer.self_attn.q_norm,
                 layer.self_attn.k_norm)
        return _Gemma3Extras(tuple(norm.weight.data_ptr() for norm in norms),
                             self.rope_kinds.index(self.model.layer_types[i]))

    def forward(self, hidden: torch.Tensor, cos_sin: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The final norm's output for this step's embeddings `hidden` [n, hidden] (scaled as the model
        scales them), or None when the step is not one this path takes (the modules run it).
        cos_sin: the step's RoPE tables [n, head_size], in `rope_kinds`' order."""
        ctx = get_forward_context()
        plan = ctx.plan
        if not isinstance(plan, NativeAttentionPlan) or hidden.shape[0] >= self.max_tokens:
            return None
        layers = self._bind(ctx.kv_caches, hidden.shape[0] >= self.low_precision_from)
        segments = None if ctx.lora is None else (ctx.lora.seg_indptr, ctx.lora.seg_slots)
        return cpu_decoder.forward(self.ops, self.dims, layers, self.model.norm.weight, hidden.contiguous(),
                                   [table.contiguous() for table in cos_sin], plan.slot_mapping, plan.block_table,
                                   plan.seq_lens, plan.seq_of_row, self.qkv_size, segments, plan.prefill_bf16)


class _Gemma3Extras(NamedTuple):
    norms: tuple[int | None, ...]  # pre- and post-feedforward, q and k norms' weights
    rope_table: int


def _wrapped(layer) -> tuple:
    """The layer's qkv, o, gate_up and down projections as the modules call them (LoRA layers, if any)."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _base(linear) -> torch.nn.Module:
    return linear.base if isinstance(linear, LoRALayer) else linear


def _linears(layer) -> tuple:
    """The layer's base linear layers, under any LoRA layers."""
    return tuple(map(_base, _wrapped(layer)))


def _lora_bindable(linear: LoRALayer) -> bool:
    """Whether the kernels can read a LoRA layer's slots in place: all of one dtype that they take under
    float32 activations, A contiguous, each B stored transposed and contiguous so (the CPU's layout), at
    most three slices."""
    dtypes = {t.dtype for t in (linear.a_stack, *linear.b_stacks)}
    return (len(linear.b_stacks) <= cpu_decoder.MAX_LORA_SLICES and len(dtypes) == 1
            and cpu_lora.supported(torch.float32, dtypes.pop()) and linear.a_stack.is_contiguous()
            and all(b.transpose(1, 2).is_contiguous() for b in linear.b_stacks))


def _lora(linear) -> cpu_decoder.Lora:
    """A linear layer's LoRA slots for the driver; an empty Lora (no delta) for a plain layer."""
    if not isinstance(linear, LoRALayer):
        return cpu_decoder.Lora()
    return cpu_decoder.lora(linear.a_stack, linear.b_stacks, linear.offsets)


def _norms(layer) -> list[torch.nn.Module]:
    """The layer's RMSNorms: Llama's two; Gemma 3's four and its per-head q and k norms."""
    attn = layer.self_attn
    found = [getattr(owner, name, None) for owner, name in (
        (layer, "input_layernorm"), (layer, "post_attention_layernorm"), (layer, "pre_feedforward_layernorm"),
        (layer, "post_feedforward_layernorm"), (attn, "q_norm"), (attn, "k_norm"))]
    return [norm for norm in found if norm is not None]


def enable(model: torch.nn.Module) -> bool:
    """Give `model` (a LlamaForCausalLM or Gemma3ForCausalLM) the native decoder where it can take it
    (kernels built, see `NativeDecoder.supports`). Returns whether it did."""
    ops = cpu_decoder.ops()
    if ops is None or not NativeDecoder.supports(model.model):
        return False
    model.model.native_decoder = NativeDecoder(model.model, ops)
    return True
