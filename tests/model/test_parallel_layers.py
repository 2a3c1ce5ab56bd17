"""The sharded layers against their whole counterparts, in real gloo groups of spawned processes,
with sizes that do not divide evenly (3 ranks: 10 KV-head rows, 7 columns, a vocabulary of 11):
each rank loads its slices from a whole weight, and the group's output equals the whole layer's."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from services.common.config import ParallelConfig
from services.worker.layers.linear import MergedLinear, RowParallelLinear, ShardRows
from services.worker.layers.vocab_parallel_embedding import VocabParallelEmbedding
from services.worker.parallel_group import GroupError, TensorParallelGroup, free_loopback_address, split_evenly

pytestmark = pytest.mark.slow  # torch.distributed groups of worker processes

SIZE = 3
HIDDEN, ROWS, COLS, VOCAB = 5, 10, 7, 11


def _whole() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(*shape, generator=g) for name, shape in {
        "column": (ROWS, HIDDEN), "column_bias": (ROWS,), "row": (HIDDEN, COLS), "row_bias": (HIDDEN,),
        "embed": (VOCAB, HIDDEN), "x": (4, HIDDEN), "x_cols": (4, COLS)}.items()}


def _rank(rank: int, address: str, results: dict) -> None:
    torch.set_num_threads(1)
    tp = TensorParallelGroup.create(ParallelConfig(SIZE, rank, address, 30.0), torch.device("cpu"))
    w = _whole()
    start, size = split_evenly(ROWS, SIZE, rank)
    column = MergedLinear(HIDDEN, {"a": ShardRows(start, size, ROWS)}, True, torch.float32)
    column.load_shard(column.weight, "a", w["column"], "column")
    column.load_shard(column.bias, "a", w["column_bias"], "column_bias")
    cols_start, cols = split_evenly(COLS, SIZE, rank)
    row = RowParallelLinear(cols, HIDDEN, True, torch.float32, tp, cols_start, COLS)
    row.load_param(row.weight, w["row"], "row")
    row.load_param(row.bias, w["row_bias"], "row_bias")
    embed = VocabParallelEmbedding(VOCAB, HIDDEN, torch.float32, tp)
    embed.load_param(embed.weight, w["embed"], "embed")
    with torch.inference_mode():
        results[rank] = {
            "column": column(w["x"]),
            "row": row(w["x_cols"][:, cols_start : cols_start + cols]),
            "embed": embed(torch.arange(VOCAB)),
            "logits": embed.logits(w["x"]),
            "min": tp.min_over_group(10 + rank),
            "tokens": tp.broadcast_tokens([7, 8] if rank == 0 else None, 2),
            "store_listens_on": _listening_addresses(int(address.rsplit(":", 1)[1])),
        }
    tp.close()


def _listening_addresses(port: int) -> set[str]:
    """The local addresses of the IPv4 and IPv6 sockets listening on `port` (from /proc/net)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                local, state = line.split()[1], line.split()[3]
                address, port_hex = local.rsplit(":", 1)
                if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found


def test_sharded_layers_equal_the_whole_ones():
    context = mp.get_context("spawn")
    with context.Manager() as manager:
        results = manager.dict()
        address = free_loopback_address()
        procs = [context.Process(target=_rank, args=(r, address, results)) for r in range(SIZE)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        results = dict(results)
    w = _whole()
    column = torch.cat([results[r]["column"] for r in range(SIZE)], dim=1)
    torch.testing.assert_close(column, F.linear(w["x"], w["column"], w["column_bias"]))
    for r in range(SIZE):
        torch.testing.assert_close(results[r]["row"], F.linear(w["x_cols"], w["row"], w["row_bias"]))
        torch.testing.assert_close(results[r]["embed"], w["embed"])
        assert results[r]["min"] == 10 and results[r]["tokens"] == [7, 8]
    assert results[0]["store_listens_on"] == {"0100007F"}  # 127.0.0.1 only, not every interface
    torch.testing.assert_close(results[0]["logits"], F.linear(w["x"], w["embed"]))
    assert results[1]["logits"] is None and results[2]["logits"] is None


def test_a_shard_of_the_wrong_checkpoint_shape_is_refused():
    column = MergedLinear(HIDDEN, {"a": ShardRows(0, 4, ROWS)}, False, torch.float32)
    with pytest.raises(ValueError, match=r"checkpoint tensor w has shape \(9, 5\), the model expects \(10, 5\)"):
        column.load_shard(column.weight, "a", torch.zeros(9, HIDDEN), "w")


def test_a_lone_rank_gives_up_after_the_timeout():
    with pytest.raises(GroupError, match="could not join its group"):
        TensorParallelGroup.create(ParallelConfig(2, 0, free_loopback_address(), 1.0), torch.device("cpu"))
