"""The vocabulary split across a tensor-parallel group (issue 13): the token embedding and the LM
head (the same matrix when tied).

Rank r holds rows [r * per_rank, (r + 1) * per_rank) with per_rank = ceil(vocab / size); the last
rank's rows past the vocabulary are zero padding, so every rank's slice has the same shape.

    embed:   each rank looks up the ids in its range (others read as zero), one all-reduce sums them
    logits:  each rank's [n, per_rank] slice is gathered on rank 0 (the driver, which samples) and
             the padding cut off; the other ranks get None

With a group of one both are plain `F.embedding` / `F.linear` over the whole vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from services.worker.layers.linear import WeightSource, copy_checked
from services.worker.parallel_group import TensorParallelGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * per_rank
        self.num_valid = max(0, min(per_rank, vocab_size - self.vocab_start))  # rows that are real tokens
        self.weight = nn.Parameter(torch.zeros(per_rank, hidden_size, dtype=dtype))  # [per_rank, hidden]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)  # [n, hidden]
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_valid)
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        out.masked_fill_(~mine.unsqueeze(1), 0)
        return self.tp.all_reduce(out)

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """[n, hidden] -> [n, vocab] float32 on rank 0, None on the others. The matmul runs in the
        model dtype, as in transformers."""
        local = F.linear(hidden_states, self.weight)  # [n, per_rank]
        if self.tp.size == 1:
            return local.float()
        gathered = self.tp.gather_to_driver(local)  # [n, size * per_rank] on rank 0
        return None if gathered is None else gathered[:, : self.vocab_size].float()

    def load_param(self, param: nn.Parameter, source: WeightSource, name: str) -> None:
        rows = slice(self.vocab_start, self.vocab_start + self.num_valid)
        copy_checked(param.data[: self.num_valid], source, name, (self.vocab_size, self.hidden_size), rows)
