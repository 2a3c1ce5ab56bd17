"""GGML's K-quant super-blocks (Q4_K, Q5_K, Q6_K: 256 weights each) made in numpy for tests: random
blocks with sane float16 scales, and a plain quantizer of float weights. gguf-py only dequantizes
these types; its dequantizers are the reference the packing here is checked against.

    Q4_K  f16 d | f16 dmin | 12 bytes of 6-bit scales and mins | 128 bytes of nibbles
    Q5_K  as Q4_K, with 32 bytes of fifth bits before the nibbles
    Q6_K  128 bytes of low nibbles | 64 bytes of 2-bit highs | 16 int8 scales | f16 d
"""

from __future__ import annotations

import gguf
import numpy as np

from kvmesh_kernels.cpu_quant_matmul import BLOCK_BYTES, K_BLOCK, QuantType

SUB = 32  # weights per sub-block
_F16_SUBNORMAL = np.float16(3e-6)  # below float16's smallest normal (6.1e-5): exact in float32 all the same


def random_blocks(rows: int, cols: int, qtype: QuantType, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols / 256 * bytes] uint8: every bit pattern of quants and scales, float16 scales that
    put weights near unit size; the first super-block of each row has a subnormal d."""
    blocks = rng.integers(0, 256, size=(rows, cols // K_BLOCK, BLOCK_BYTES[qtype]), dtype=np.uint8)
    levels = {QuantType.Q4_K: 15 * 63, QuantType.Q5_K: 31 * 63, QuantType.Q6_K: 32 * 127}[qtype]
    d = (rng.uniform(0.5, 2.0, size=blocks.shape[:2]) / levels).astype(np.float16)
    d[:, 0] = _F16_SUBNORMAL
    if qtype == QuantType.Q6_K:
        blocks[..., 208:210] = d[..., None].view(np.uint8)
    else:
        dmin = (rng.uniform(0.0, 1.0, size=blocks.shape[:2]) / 63).astype(np.float16)
        blocks[..., 0:2] = d[..., None].view(np.uint8)
        blocks[..., 2:4] = dmin[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def dequantize(blocks: np.ndarray, qtype: QuantType, cols: int) -> np.ndarray:
    """gguf-py's dequantization: [rows, cols] float32."""
    values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype))
    return np.ascontiguousarray(values, dtype=np.float32).reshape(blocks.shape[0], cols)


def quantize(values: np.ndarray, qtype: QuantType) -> np.ndarray:
    """[rows, cols] float (cols a multiple of 256) -> K-quant blocks [rows, cols / 256 * bytes]: scale
    and offset by sub-block's range, rounded to nearest (llama.cpp searches further; any valid
    blocks serve a test)."""
    rows, cols = values.shape
    x = values.astype(np.float32).reshape(-1, K_BLOCK)  # [super-blocks, 256]
    if qtype == QuantType.Q6_K:
        return _quantize_q6_k(x).reshape(rows, -1)
    top = 15 if qtype == QuantType.Q4_K else 31
    sub = x.reshape(-1, 8, SUB)
    low = np.minimum(sub.min(-1), 0.0)
    scale, offset = (sub.max(-1) - low) / top, -low  # [super-blocks, 8], w = scale * q - offset
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (offset.max(-1) / 63).astype(np.float16)
    sc = _ratio(scale, d, 63)
    m = _ratio(offset, dmin, 63)
    step = d.astype(np.float32)[:, None] * sc  # the weights' scales as dequantized
    shift = dmin.astype(np.float32)[:, None] * m
    safe = np.where(step > 0, step, 1.0)[..., None]
    q = np.where(step[..., None] > 0, np.rint((sub + shift[..., None]) / safe), 0).clip(0, top).astype(np.uint8)
    scales = _pack_scales(sc.astype(np.uint8), m.astype(np.uint8))
    nibbles = (q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)  # sub-blocks 2p (low) and 2p + 1 (high)
    parts = [d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), scales]
    if qtype == QuantType.Q5_K:
        parts.append(((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(1, dtype=np.uint8))  # bit s of byte j
    parts.append(nibbles.reshape(-1, 128))
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _ratio(values: np.ndarray, unit: np.ndarray, top: int) -> np.ndarray:
    """round(values / unit) in 0..top, 0 where unit is 0 ([super-blocks, 8] float32)."""
    unit32 = unit.astype(np.float32)[:, None]
    return np.where(unit32 > 0, np.rint(values / np.where(unit32 > 0, unit32, 1.0)), 0).clip(0, top)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins -> 12 bytes (gguf-py's Q4_K.get_scale_min, inverted)."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)  # a scale per 16 weights
    biggest = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]
    scale = biggest / -32  # the largest magnitude lands on -32, the widest level
    d = (np.abs(scale).max(-1) / 127).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    sc = np.where(d32 > 0, np.rint(scale / np.where(d32 > 0, d32, 1.0)), 0).clip(-128, 127)
    step = (d32 * sc)[..., None]
    q = np.where(step != 0, np.rint(sub / np.where(step != 0, step, 1.0)), 0).clip(-32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, SUB)  # [super-blocks, half, t, 32]: sub-block 4 half + t
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)],
                        axis=-1)  # [super-blocks, half, 64]
    qh = (q >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]
    qh = qh.sum(2, dtype=np.uint8)  # [super-blocks, half, 32]
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8),
                           d[:, None].view(np.uint8)], axis=-1)
