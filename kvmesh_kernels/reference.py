"""Plain-torch references for the Triton kernels, over the same paged KV-cache layout
(services/worker/kv_cache.py):

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size]   # 0 = K, 1 = V

They loop over tokens and requests (the batched LoRA ones over segments) and compute in float32:
slow, obvious, and the truth the kernel tests compare against. Not used on any serving path (the
torch backend is the batched CPU path), except the LoRA ones on a CPU where the native kernels did
not build (kvmesh_kernels/lora.py).
"""

from __future__ import annotations

import torch


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """Write token t's K/V ([num_tokens, num_kv_heads, head_size]) into slot `slot_mapping[t]`
    (block slot // block_size, row slot % block_size); slots of -1 are padding and skipped."""
    block_size = kv_cache.shape[2]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        kv_cache[0, slot // block_size, slot % block_size] = key[t]
        kv_cache[1, slot // block_size, slot % block_size] = value[t]


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole paged context.

    q: [num_tokens, num_heads, head_size], request i's tokens at query_start_loc[i]:query_start_loc[i+1];
    its context is seq_lens[i] tokens in blocks block_table[i], the last q_len of them the new ones, so
    its token j sits at position seq_lens[i] - q_len + j and attends to the positions p with
    p <= that one and, with a window W, p > that one - W (W tokens, itself included).
    Returns [num_tokens, num_heads, head_size] in q's dtype.
    """
    num_heads, head_size = q.shape[1:]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        kv_pos = torch.arange(seq_len)
        blocks = block_table[i].cpu()[kv_pos // block_size].long()
        k = kv_cache[0, blocks.to(kv_cache.device), (kv_pos % block_size).to(kv_cache.device)].float()
        v = kv_cache[1, blocks.to(kv_cache.device), (kv_pos % block_size).to(kv_cache.device)].float()
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, seq_len, head_size]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qi = q[start:end].float().transpose(0, 1)  # [num_heads, q_len, head_size]
        scores = qi @ k.transpose(1, 2) * scale  # [num_heads, q_len, seq_len]
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        q_pos = torch.arange(seq_len - q_len, seq_len)
        allowed = kv_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            allowed &= kv_pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        out[start:end] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).to(q.dtype)
    return out


def lora_shrink_ref(x: torch.Tensor, a_stack: torch.Tensor, seg_indptr: torch.Tensor,
                    seg_slots: torch.Tensor) -> torch.Tensor:
    """LoRA's first product over a batch of segments: rows seg_indptr[i]:seg_indptr[i+1] of x ([T, in])
    times a_stack[seg_slots[i]].T ([S, R, in]); rows of slot -1 segments are zeros. Returns [T, R] float32."""
    out = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
    bounds = seg_indptr.tolist()
    for i, slot in enumerate(seg_slots.tolist()):
        start, end = bounds[i], bounds[i + 1]
        if slot >= 0 and end > start:
            out[start:end] = x[start:end].float() @ a_stack[slot].float().T
    return out


def lora_expand_ref(out: torch.Tensor, y: torch.Tensor, b_stack: torch.Tensor, seg_indptr: torch.Tensor,
                    seg_slots: torch.Tensor, out_offset: int) -> None:
    """LoRA's second product, in place: out[rows, out_offset:out_offset + n] += y[rows] @ b_stack[slot].T
    ([S, n, R]) for the segments of a slot >= 0, summed in float32 and rounded once to out's dtype."""
    n = b_stack.shape[1]
    bounds = seg_indptr.tolist()
    for i, slot in enumerate(seg_slots.tolist()):
        start, end = bounds[i], bounds[i + 1]
        if slot >= 0 and end > start:
            cols = out[start:end, out_offset:out_offset + n]
            cols.copy_((cols.float() + y[start:end].float() @ b_stack[slot].float().T).to(out.dtype))
