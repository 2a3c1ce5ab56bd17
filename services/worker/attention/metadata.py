"""Per-step attention metadata, named as the kernels name it.

The batch is a flat run of tokens, request after request:

    tokens:           | r0: q0 tokens | r1: q1 tokens | ... |
    query_start_loc:  [0, q0, q0+q1, ...]                      # [num_reqs + 1]
    seq_lens:         context length of each request after this step (cached + new)   # [num_reqs]
    positions:        absolute position of each token            # [num_tokens]
    slot_mapping:     block_id * block_size + offset of each token's K/V; -1 = padding, skipped
    block_table:      the blocks of each request, padded with 0  # [num_reqs, max_blocks]

Token j of request i sits at position seq_lens[i] - q_i + j and attends to positions 0..that one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    num_tokens: int
    num_reqs: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    block_size: int
    max_query_len: int
    max_seq_len: int
    # Host copies, so that backends can plan without a device sync.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
