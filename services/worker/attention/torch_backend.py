"""Paged attention in plain torch, batched, for the CPU (and as a fallback anywhere), or with the
native CPU kernels.

Per step, `plan()` turns the metadata into gather indices once; every layer then
  "torch":
  1. writes the step's K/V into the paged cache (one index_copy_ per K and V),
  2. attends all single-token decodes in ONE batched call: SDPA over their gathered blocks,
  3. attends each prefill chunk with one SDPA call per chunk (compute-bound; no per-token loop).
  "cpu":
  1. writes the step's K/V with one native call (kvmesh_kernels/cpu_fused_ops.py),
  2. attends every token of the step, decodes and prefill chunks alike, in ONE native call that
     reads the paged cache in place (kvmesh_kernels/cpu_paged_attention.py): each token is a row with its
     own causal context length, no gather, no mask, no per-request loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmesh_kernels import cpu_fused_ops
from kvmesh_kernels.cpu_paged_attention import paged_decode_attention
from services.worker.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class _Prefill:
    start: int  # first token of the chunk in the flat batch
    end: int
    blocks: torch.Tensor  # [num_blocks] the context's blocks; positions past seq_len are sliced off
    q_pos: torch.Tensor  # [q_len] positions of the chunk's tokens
    kv_pos: torch.Tensor  # [seq_len]
    mask: torch.Tensor  # [1, 1, q_len, seq_len] causal


@dataclass(slots=True)
class TorchAttentionPlan:
    slot_mapping: torch.Tensor  # [n] int64, -1 = padding
    write_slots: torch.Tensor  # [n] valid slots
    write_rows: torch.Tensor | None  # [n] tokens that have them; None: every token
    decode_rows: torch.Tensor  # [num_decodes] token index of each decode
    decode_blocks: torch.Tensor  # [num_decodes, num_blocks] block tables, 0-padded
    decode_q_pos: torch.Tensor  # [num_decodes]
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, num_blocks * block_size] True = attend
    decode_block_table: torch.Tensor  # [num_decodes, num_blocks] int32, for the native kernel
    decode_seq_lens: torch.Tensor  # [num_decodes] int32
    all_decodes: bool  # every token is a decode, in request order: no gather/scatter of q and out
    prefills: list[_Prefill]


@dataclass(slots=True)
class NativeAttentionPlan:
    slot_mapping: torch.Tensor  # [n] int64, -1 = padding
    write_slots: torch.Tensor  # [n] valid slots (the index_copy_ write, when the fused ops are not built)
    write_rows: torch.Tensor | None  # [n] tokens that have them; None: every token
    block_table: torch.Tensor  # [num_reqs, num_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [n] int32: token i attends the first seq_lens[i] tokens of its request
    seq_of_row: torch.Tensor | None  # [n] int32: token i's request; None: every token is a decode, in order
    prefill_bf16: bool  # the kernel multiplies prefill runs' operands in bfloat16


class TorchAttentionBackend:
    def __init__(self, native_decode: bool = False, prefill_bf16: bool = False) -> None:
        self.native_decode = native_decode
        self.prefill_bf16 = prefill_bf16
        self.name = "cpu" if native_decode else "torch"

    def plan(self, meta: AttentionMetadata) -> TorchAttentionPlan | NativeAttentionPlan:
        device = meta.slot_mapping.device
        write_slots, write_rows = _write_plan(meta.slot_mapping)
        if self.native_decode and sum(meta.query_lens_cpu) == meta.num_tokens:
            return _native_plan(meta, write_slots, write_rows, self.prefill_bf16)

        bs = meta.block_size
        decode_reqs, prefills = [], []
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            if q_len == 1:
                decode_reqs.append(i)
            elif q_len > 1:
                kv_pos = torch.arange(seq_len, device=device)
                blocks = meta.block_table[i, : -(-seq_len // bs)].long()
                q_pos = kv_pos[seq_len - q_len :]
                mask = (kv_pos[None, :] <= q_pos[:, None])[None, None]
                prefills.append(_Prefill(start, start + q_len, blocks, q_pos, kv_pos, mask))
            start += q_len

        if decode_reqs:
            idx = torch.tensor(decode_reqs, device=device)
            rows = meta.query_start_loc[idx].long()
            seq_lens = meta.seq_lens[idx].long()
            num_blocks = -(-max(meta.seq_lens_cpu[i] for i in decode_reqs) // bs)
            # Whole blocks are gathered (contiguous copies), positions past each context masked.
            table = meta.block_table[idx, :num_blocks].contiguous()  # [num_decodes, num_blocks] int32
            blocks = table.long()
            kv_pos = torch.arange(num_blocks * bs, device=device)
            mask = (kv_pos[None, :] < seq_lens[:, None])[:, None, None, :]
            q_pos = seq_lens - 1
            seq_lens_i32 = seq_lens.int()
        else:
            rows = blocks = q_pos = mask = table = seq_lens_i32 = torch.empty(0, dtype=torch.long, device=device)
        all_decodes = len(decode_reqs) == meta.num_tokens
        return TorchAttentionPlan(meta.slot_mapping, write_slots, write_rows, rows, blocks, q_pos, mask, table, seq_lens_i32,
                                  all_decodes, prefills)

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, plan: TorchAttentionPlan | NativeAttentionPlan) -> torch.Tensor:
        # q: [num_tokens, H, D]; k, v: [num_tokens, Hkv, D]; kv_cache: [2, num_blocks, block_size, Hkv, D]
        num_kv_heads, head_size = kv_cache.shape[-2:]
        k_flat = kv_cache[0].view(-1, num_kv_heads, head_size)
        v_flat = kv_cache[1].view(-1, num_kv_heads, head_size)
        if self.native_decode and cpu_fused_ops.usable(k):
            cpu_fused_ops.kv_write(kv_cache[0], kv_cache[1], k, v, plan.slot_mapping)  # one call, pads skipped
        elif plan.write_rows is None:
            k_flat.index_copy_(0, plan.write_slots, k)
            v_flat.index_copy_(0, plan.write_slots, v)
        else:
            k_flat.index_copy_(0, plan.write_slots, k[plan.write_rows])
            v_flat.index_copy_(0, plan.write_slots, v[plan.write_rows])

        out = torch.empty_like(q)
        window = layer.sliding_window
        if isinstance(plan, NativeAttentionPlan):
            return paged_decode_attention(out, q, kv_cache[0], kv_cache[1], plan.block_table, plan.seq_lens,
                                          layer.scale, window, layer.logits_soft_cap, seq_of_row=plan.seq_of_row,
                                          prefill_bf16=plan.prefill_bf16)
        if plan.decode_rows.numel() and self.native_decode:
            qd = q if plan.all_decodes else q[plan.decode_rows]  # [B, H, D]
            od = out if plan.all_decodes else torch.empty_like(qd)
            paged_decode_attention(od, qd, kv_cache[0], kv_cache[1], plan.decode_block_table,
                                   plan.decode_seq_lens, layer.scale, window, layer.logits_soft_cap)
            if not plan.all_decodes:
                out[plan.decode_rows] = od
        elif plan.decode_rows.numel():
            mask = plan.decode_mask
            if window is not None:
                kv_pos = torch.arange(mask.shape[-1], device=q.device)
                mask = mask & (kv_pos[None, :] > (plan.decode_q_pos[:, None] - window))[:, None, None, :]
            b = plan.decode_blocks.shape[0]
            qd = q[plan.decode_rows].unsqueeze(2)  # [B, H, 1, D]
            kd = _gather_blocks(kv_cache[0], plan.decode_blocks).view(b, -1, num_kv_heads, head_size).transpose(1, 2)
            vd = _gather_blocks(kv_cache[1], plan.decode_blocks).view(b, -1, num_kv_heads, head_size).transpose(1, 2)
            out[plan.decode_rows] = _attend(qd, kd, vd, mask, layer.scale, layer.logits_soft_cap).squeeze(2)
        for p in plan.prefills:
            mask = p.mask
            if window is not None:
                mask = mask & (p.kv_pos[None, :] > (p.q_pos[:, None] - window))[None, None]
            qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            seq_len = p.kv_pos.shape[0]
            kp = _gather_blocks(kv_cache[0], p.blocks).view(-1, num_kv_heads, head_size)[:seq_len]
            vp = _gather_blocks(kv_cache[1], p.blocks).view(-1, num_kv_heads, head_size)[:seq_len]
            kp, vp = kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            out[p.start : p.end] = _attend(qp, kp, vp, mask, layer.scale, layer.logits_soft_cap)[0].transpose(0, 1)
        return out


def _write_plan(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the valid slots, the tokens that have them or None for every token)."""
    valid = slot_mapping >= 0
    if bool(valid.all()):
        return slot_mapping, None
    write_rows = valid.nonzero().squeeze(1)
    return slot_mapping[write_rows], write_rows


def _native_plan(meta: AttentionMetadata, write_slots: torch.Tensor, write_rows: torch.Tensor | None,
                 prefill_bf16: bool) -> NativeAttentionPlan:
    """Every token a row of the native kernel. Token j of request i (q_i new tokens) sits at position
    seq_lens[i] - q_i + j, so it attends the request's first seq_lens[i] - q_i + j + 1 tokens."""
    block_table = meta.block_table.contiguous()
    if meta.max_query_len == 1 and meta.num_reqs == meta.num_tokens:  # decodes only: row i is request i
        return NativeAttentionPlan(meta.slot_mapping, write_slots, write_rows, block_table, meta.seq_lens.int(), None,
                                   prefill_bf16)
    device = meta.slot_mapping.device
    q_lens = torch.tensor(meta.query_lens_cpu, device=device)
    seq_of_row = torch.repeat_interleave(torch.arange(meta.num_reqs, device=device), q_lens)  # [n]
    ends = meta.query_start_loc[1:].long()  # [num_reqs] one past each request's last token
    tokens_after = ends[seq_of_row] - 1 - torch.arange(meta.num_tokens, device=device)  # later tokens of its request
    seq_lens = (meta.seq_lens.long()[seq_of_row] - tokens_after).int()
    return NativeAttentionPlan(meta.slot_mapping, write_slots, write_rows, block_table, seq_lens, seq_of_row.int(),
                               prefill_bf16)


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache: [num_blocks, block_size, Hkv, D]; blocks: any shape of block ids -> [blocks.numel(), ...].
    index_select over whole blocks is several times faster on CPU than advanced indexing."""
    flat = cache.view(cache.shape[0], -1)
    return torch.index_select(flat, 0, blocks.reshape(-1))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            soft_cap: float | None) -> torch.Tensor:
    """q: [B, H, Q, D]; k, v: [B, Hkv, L, D]; mask: [B|1, 1, Q, L] bool -> [B, H, Q, D]."""
    if soft_cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    b, h, n_q, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, h // hkv * n_q, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, Hkv, G*Q, L]
    scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.view(b, hkv, h // hkv, n_q, -1).masked_fill(~mask.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, hkv, h // hkv * n_q, -1)
    return torch.matmul(probs, v).view(b, h, n_q, d)
