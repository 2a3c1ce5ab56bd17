"""The vocabulary split across a tensor-parallel group: the token embedding and the LM
head (the same matrix when tied).

Rank r holds rows [r * per_rank, (r + 1) * per_rank) with per_rank = ceil(vocab / size); the last
rank's rows past the vocabulary are zero padding, so every rank's slice has the same shape.

    embed:   each rank looks up the ids in its range (others read as zero), one all-reduce sums them
    logits:  each rank's [n, per_rank] slice is gathered on rank 0 (the driver, which samples) and
             the padding cut off; the other ranks get None

With a group of one both are plain `F.embedding` / `F.linear` over the whole vocabulary. Given a
GGUF file's blocks, the table stays in them: a lookup dequantizes its rows, the logits
are the native quantized matmul.
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.layers.linear import WeightSource, check_shape, copy_checked
from services.worker.layers.quantized_weight import BlockWeightHolder, GGUFBlocks
from services.worker.parallel_group import TensorParallelGroup


class VocabParallelEmbedding(nn.Module, BlockWeightHolder):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * per_rank
        self.num_valid = max(0, min(per_rank, vocab_size - self.vocab_start))  # rows that are real tokens
        self.weight = nn.Parameter(torch.zeros(per_rank, hidden_size, dtype=dtype))  # [per_rank, hidden]
        self.block_weight = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.embedding(input_ids)  # [n, hidden]
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_valid)
        out = self.embedding(torch.where(mine, local, 0))
        out.masked_fill_(~mine.unsqueeze(1), 0)
        return self.tp.all_reduce(out)

    def logits(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """[n, hidden] -> [n, vocab] float32 on rank 0, None on the others. The matmul runs in the
        model dtype, as in transformers. `out`, [n, vocab] float32: where they go, without tensor
        parallelism (a caller's buffer, kept across steps)."""
        if self.tp.size == 1:
            return self.linear(hidden_states, out=out).float()
        local = self.linear(hidden_states)  # [n, per_rank]
        gathered = self.tp.gather_to_driver(local)  # [n, size * per_rank] on rank 0
        return None if gathered is None else gathered[:, : self.vocab_size].float()

    def load_param(self, param: nn.Parameter, source: WeightSource, name: str) -> None:
        rows = slice(self.vocab_start, self.vocab_start + self.num_valid)
        full_shape = (self.vocab_size, self.hidden_size)
        if isinstance(source, GGUFBlocks):
            check_shape(source, name, full_shape)
            self.keep_blocks([(0, source[rows])], whole=True, padded_rows=param.shape[0] - self.num_valid)
        else:
            copy_checked(param.data[: self.num_valid], source, name, full_shape, rows)
