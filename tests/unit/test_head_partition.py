"""How a tensor-parallel group splits attention heads, rows and its configuration's bounds."""

from __future__ import annotations

import pytest

from services.common.config import ParallelConfig
from services.common.flags import build
from services.worker import server as worker_server
from services.worker.models.llama import HeadPartition
from services.worker.parallel_group import split_evenly


def test_split_evenly_gives_the_first_ranks_the_remainder():
    assert [split_evenly(10, 3, i) for i in range(3)] == [(0, 4), (4, 3), (7, 3)]
    assert [split_evenly(8, 2, i) for i in range(2)] == [(0, 4), (4, 4)]


def test_heads_follow_their_kv_heads():
    # SmolLM2: 9 q heads in 3 groups of 3.
    assert [HeadPartition.of(9, 3, r, 2) for r in range(2)] == [(0, 6, 0, 2), (6, 3, 2, 1)]
    assert [HeadPartition.of(9, 3, r, 3) for r in range(3)] == [(0, 3, 0, 1), (3, 3, 1, 1), (6, 3, 2, 1)]
    assert HeadPartition.of(9, 3, 0, 1) == (0, 9, 0, 3)
    assert [HeadPartition.of(32, 8, r, 2) for r in range(2)] == [(0, 16, 0, 4), (16, 16, 4, 4)]


def test_fewer_kv_heads_than_ranks_replicates_them():
    # 8 q heads, 2 KV heads, 4 ranks: each KV head on 2 ranks, which split its 4 q heads.
    assert [HeadPartition.of(8, 2, r, 4) for r in range(4)] == [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]
    with pytest.raises(ValueError, match="cannot be split across 3 ranks"):
        HeadPartition.of(4, 2, 0, 3)
    with pytest.raises(ValueError, match="cannot be split across 8 ranks"):
        HeadPartition.of(4, 2, 0, 8)


def test_parallel_config_bounds_and_flags():
    with pytest.raises(ValueError, match="rank 2 is outside a tensor-parallel group of 2"):
        ParallelConfig(tensor_parallel_size=2, rank=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="must be host:port"):
        ParallelConfig(2, 0, "localhost")
    parser = worker_server.build_parser()
    args = parser.parse_args(["--tensor-parallel-size", "2", "--rank", "1", "--distributed-address", "10.0.0.5:29500",
                              "--distributed-timeout", "3"])
    assert build(parser, ParallelConfig, args) == ParallelConfig(2, 1, "10.0.0.5:29500", 3.0)
