"""Weights kept in GGUF blocks for the native CPU kernel (`--quantization`): a GGUF model's
own (`gguf`, `GGUFWeights`), or any model's quantized at load (`int8`: Q8_0 blocks, `f16`: float16;
`LoadQuantizedWeights`).

The worker still builds its model from the Hugging Face folder the file was converted to
(services/worker/loader.py): config, tokenizer and every tensor kept as floats come from there. This
module hands the layers, under the Hugging Face names, the blocks of the 2-D weights instead
(`GGUFWeights.overlay`), in the converted model's row order, so that the native kernel computes
with exactly the weights the folder holds in float32 at a sixth of the bytes (Q4_1).

The rows: llama.cpp's converter permutes the rows of q and k of a Llama for its RoPE (pairs of
rotated values interleaved); transformers un-permutes them when it converts (`LlamaTensorProcessor`),
and so does `_row_order` here, on whole rows of blocks. Only architectures whose tensors transformers
converts without other changes are kept in blocks (`_ARCHITECTURES`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch

from kvmesh_kernels import cpu_quant_matmul
from kvmesh_kernels.cpu_quant_matmul import QuantType
from kvmesh_kernels.native import NativeKernelUnavailable, cpu_has
from services.common.gguf_file import GGUFFile
from services.common.model_files import is_gguf_model, locate_model
from services.worker.layers.linear import WeightSource, shape_of
from services.worker.layers.quantized_weight import GGUFBlocks

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --quantization -> the blocks a checkpoint's weights are quantized to at load.
_AT_LOAD = {"int8": QuantType.Q8_0, "f16": QuantType.F16}
# Block types the kernel does not read whose values Q8_0 holds exactly: Q4_0's and Q5_0's are
# d * (q - 8) and d * (q - 16) with an f16 scale d per 32 weights, as Q8_0's are d * q8. llama.cpp's
# K-quant mixes fall back to Q5_0 (and Q4_0) for rows that are not a multiple of 256 weights
# (Gemma 3 270M's 640): widened, they take the native kernel instead of float32 at 1.5x their bytes.
_WIDENED_TO_Q8_0 = {gguf.GGMLQuantizationType.Q4_0: 4, gguf.GGMLQuantizationType.Q5_0: 5}
# GGUF architecture -> whether its q and k rows are permuted (see the module's docstring). Gemma 3's
# norm weights are stored plus one (transformers subtracts it); norms are 1-D, never kept in blocks.
_ARCHITECTURES = {"llama": True, "qwen2": False, "gemma3": False}


class NotQuantizable(ValueError):
    """Why a model's weights cannot stay in their GGUF blocks."""


class GGUFWeights:
    """The tensors of one GGUF file (memory-mapped: a tensor is read when a layer copies it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = GGUFFile(path)
        self.architecture = self.file.field("general.architecture")
        if self.architecture not in _ARCHITECTURES:
            raise NotQuantizable(f"{path}: weights of a {self.architecture!r} GGUF model are not kept in blocks "
                             f"(architectures: {', '.join(_ARCHITECTURES)})")
        arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}[self.architecture]
        self.names = gguf.get_tensor_name_map(arch, int(self.file.field(f"{self.architecture}.block_count")))
        self.tensors = self.file.tensors
        self.num_heads = self.file.field(f"{self.architecture}.attention.head_count")
        self.num_kv_heads = self.file.field(f"{self.architecture}.attention.head_count_kv")
        dequantized = sorted({gguf.GGMLQuantizationType(t.tensor_type).name for t in self.tensors.values()
                              if len(t.shape) == 2 and t.tensor_type != gguf.GGMLQuantizationType.F32
                              and t.tensor_type not in cpu_quant_matmul.FILE_TYPES
                              and t.tensor_type not in _WIDENED_TO_Q8_0})
        widened = sorted({gguf.GGMLQuantizationType(t.tensor_type).name for t in self.tensors.values()
                          if len(t.shape) == 2 and t.tensor_type in _WIDENED_TO_Q8_0})
        if widened:
            logger.info("%s: %s weights widened to Q8_0 blocks at load (the same values)", path.name,
                        ", ".join(widened))
        if dequantized:
            logger.info("%s: %s weights dequantized to float32 at load (the kernel keeps %s blocks)", path.name,
                        ", ".join(dequantized), ", ".join(t.name for t in cpu_quant_matmul.FILE_TYPES))

    def blocks(self, name: str) -> GGUFBlocks | None:
        """The blocks of checkpoint tensor `name` (a Hugging Face name), or None where it is no 2-D
        weight in blocks the kernel reads (those stay the folder's floats)."""
        base, _, suffix = name.rpartition(".")
        gguf_name = self.names.get_name(base)
        tensor = self.tensors.get(f"{gguf_name}.{suffix}") if gguf_name else None
        if tensor is None or len(tensor.shape) != 2:
            return None
        cols, rows = (int(n) for n in tensor.shape)  # GGUF lists the fastest dimension first
        data = np.asarray(tensor.data).view(np.uint8).reshape(rows, -1)
        if tensor.tensor_type in _WIDENED_TO_Q8_0:
            data = widen_to_q8_0(data, _WIDENED_TO_Q8_0[tensor.tensor_type])
            qtype = QuantType.Q8_0
        else:
            try:
                qtype = QuantType(int(tensor.tensor_type))
            except ValueError:
                return None
        if qtype not in cpu_quant_matmul.FILE_TYPES:
            return None
        if cols % cpu_quant_matmul.block_weights(qtype) or data.shape[1] != cpu_quant_matmul.row_bytes(qtype, cols):
            return None
        order = self._row_order(gguf_name, rows)
        return GGUFBlocks(qtype, data if order is None else data[order], cols)

    def _row_order(self, gguf_name: str, rows: int) -> np.ndarray | None:
        """transformers' `_reverse_permute_weights` as a row order, or None to keep the file's."""
        if not _ARCHITECTURES[self.architecture] or None in (self.num_heads, self.num_kv_heads):
            return None
        if gguf_name.endswith(".attn_q"):
            heads = self.num_heads
        elif gguf_name.endswith(".attn_k"):
            heads = self.num_kv_heads
        else:
            return None
        half = rows // heads // 2
        # [heads, 2, half] in the file -> [heads, half, 2] in the model: row (h, j, i) of the model
        # is row (h, i, j) of the file.
        return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1)

    def overlay(self, weights: Iterator[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        """`weights` (the converted folder's), each 2-D weight the kernel reads replaced by its blocks."""
        for name, source in weights:
            blocks = self.blocks(name)
            yield name, source if blocks is None else blocks


def widen_to_q8_0(data: np.ndarray, bits: int) -> np.ndarray:
    """[rows, row_bytes] Q4_0 (bits 4) or Q5_0 (bits 5) blocks -> the same values as Q8_0 blocks.
    A block is its f16 scale, (Q5_0) 32 fifth bits in a little-endian uint32, then 16 bytes whose low
    nibbles are weights 0-15 and high nibbles weights 16-31; Q8_0 is the scale and 32 int8 weights."""
    rows = data.shape[0]
    blocks = data.reshape(-1, 18 if bits == 4 else 22)
    scale, packed = blocks[:, :2], blocks[:, -16:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.int16)  # [blocks, 32]
    if bits == 5:
        high = blocks[:, 2:6].copy().view("<u4")  # [blocks, 1]
        q |= (((high >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int16)
    q -= 1 << (bits - 1)
    out = np.concatenate([scale, q.astype(np.int8).view(np.uint8)], axis=1)  # [blocks, 34]
    return np.ascontiguousarray(out.reshape(rows, -1))


class LoadQuantizedWeights:
    """Every 2-D weight (layers, embedding, LM head) of a checkpoint quantized at load by gguf's own
    quantizer: Q8_0 is weight-only int8 (int8 values, one f16 scale per 32: finer than a scale per
    output channel), F16 rounds to float16. Not the checkpoint's weights any more: the agreement
    with the float model is measured (docs/benchmarks/index.md), not tested for exactness."""

    def __init__(self, qtype: QuantType) -> None:
        self.qtype = qtype

    def overlay(self, weights: Iterator[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        for name, source in weights:
            shape = shape_of(source)
            if not name.endswith(".weight") or len(shape) != 2 or shape[1] % cpu_quant_matmul.BLOCK:
                yield name, source
                continue
            values = source[:].float().numpy()
            data = gguf.quants.quantize(values, gguf.GGMLQuantizationType(self.qtype))
            yield name, GGUFBlocks(self.qtype, data.view(np.uint8).reshape(shape[0], -1), shape[1])


def resolve_dtype(dtype: str, quantization: str, model: str, device: torch.device) -> torch.dtype:
    """`--dtype` as a torch dtype, `auto` resolved to the fastest this device runs natively: float32
    where the weights stay in GGUF blocks (their kernel computes in float32, exactly); else on a CPU
    bfloat16 where it has bfloat16 instructions (AVX512_BF16, AMX-BF16: torch's GEMM uses them),
    float32 otherwise (without them torch's bfloat16 matmuls are slower than float32's from a batch
    of 8 up, and float16 ones, through the float32 tiles, are float32's speed at float16's rounding);
    on a GPU bfloat16 where supported, else float16."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type != "cpu":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float16
    in_blocks = quantization in _AT_LOAD or (quantization in ("auto", "gguf") and is_gguf_model(model))
    if not in_blocks and (cpu_has("avx512_bf16") or cpu_has("amx_bf16")):
        return torch.bfloat16
    return torch.float32


def block_gemm_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The arithmetic of the larger steps' matmuls (prefill chunks, decode batches from
    quantized_weight.LOW_PRECISION_GEMM_ROWS rows) over weights kept in GGUF blocks, for `--dtype auto`
    on a CPU: the fastest of the copies its instructions allow, by a probe at start-up
    (cpu_quant_matmul.fastest_copy). The candidates: bfloat16 where it has bfloat16 instructions
    (AVX512_BF16, AMX-BF16: torch's bfloat16 GEMM at prefill sizes, the dot-product instruction
    below); int8 where the kernel has AVX2 (x quantized to 8 bits per 32-block against the file's
    weights in integer dot products, as llama.cpp and vLLM's GGUF kernels compute). Float32 where
    no copy measures at least 5 % faster than the float32 tiles. Measured: on Zen 4 int8 (VNNI) beat
    bfloat16, whose dot products run at half width there. The LM head's larger steps too. Smaller
    steps stay float32 over the exact weights either way; the low-precision steps' activations, KV
    and logits carry its rounding (the agreement with transformers: loadtests/int8_agreement.py
    --dtype auto; docs/benchmarks/index.md). Without the kernel built there are no blocks to copy:
    float32."""
    if dtype != "auto" or device.type != "cpu" or not cpu_quant_matmul.is_built():
        return torch.float32
    proposed = {}
    if cpu_has("avx512_bf16") or cpu_has("amx_bf16"):
        proposed[QuantType.BF16] = torch.bfloat16
    if cpu_has("avx2", "fma", "f16c"):
        proposed[QuantType.Q4_1_I8] = torch.int8
    if not proposed:
        return torch.float32
    fastest = cpu_quant_matmul.fastest_copy(tuple(proposed))
    names = ", ".join(str(d).removeprefix("torch.") for d in proposed.values())
    if fastest is not None:
        logger.info("--dtype auto: larger steps multiply in %s, measured the fastest of %s, float32 on this CPU",
                    str(proposed[fastest]).removeprefix("torch."), names)
        return proposed[fastest]
    logger.info("--dtype auto: %s copies measured no faster than the float32 tiles on this CPU; larger steps "
                "stay float32", names)
    return torch.float32


def gguf_weights_for(quantization: str, model: str, device: torch.device, dtype: torch.dtype,
                     cache_dir: Path) -> GGUFWeights | LoadQuantizedWeights | None:
    """The weights to keep in GGUF blocks for `--quantization` (config.QUANTIZATIONS), or None for
    floats. `auto` keeps a GGUF model's where they can be (a .gguf model, float32 on the CPU, a vector
    build of the kernel) and logs why not otherwise; the others raise instead."""
    if quantization == "none":
        return None
    try:
        if quantization in _AT_LOAD:
            _check_kernel(device, dtype, cache_dir, vector_build=False)
            return LoadQuantizedWeights(_AT_LOAD[quantization])
        if not locate_model(model, cache_dir).is_file():
            raise NotQuantizable("the model is not a .gguf file")
        _check_kernel(device, dtype, cache_dir, vector_build=quantization == "auto")
        return GGUFWeights(locate_model(model, cache_dir))
    except NotQuantizable as exc:
        if quantization != "auto":
            raise NotQuantizable(f"--quantization {quantization}: {exc}") from exc
        logger.info("weights dequantized to %s: %s", dtype, exc)
        return None


def _check_kernel(device: torch.device, dtype: torch.dtype, cache_dir: Path, vector_build: bool) -> None:
    if device.type != "cpu":
        raise NotQuantizable(f"the native kernel runs on the CPU, not on {device}")
    if dtype != torch.float32:
        raise NotQuantizable(f"the kernel computes in float32 (--dtype float32), not {dtype}")
    try:
        cpu_quant_matmul.build(cache_dir)
    except NativeKernelUnavailable as exc:
        raise NotQuantizable(f"the native kernel could not be built: {exc}") from exc
    if vector_build and cpu_quant_matmul.isa() == 0:
        raise NotQuantizable("this CPU has neither AVX2 nor AVX-512 (the portable kernel is slower than float32 "
                             "weights)")
