"""The engine's check that the workers it was given are one tensor-parallel group of one model
(services/engine/executor.py check_group)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.common.clients import WorkerInfo
from services.engine.executor import check_group

BASE = WorkerInfo(model_id="m", model_path="/m", vocab_size=100, max_model_len=256, block_size=16)


def rank(r: int, size: int) -> WorkerInfo:
    return replace(BASE, rank=r, world_size=size)


def test_one_worker_alone_is_a_group():
    check_group([BASE])


def test_workers_that_each_run_alone_are_no_group():
    with pytest.raises(ValueError, match=r"2 workers, but they report a tensor-parallel size of \[1\]"):
        check_group([BASE, BASE])


def test_ranks_in_order_each_once():
    check_group([rank(0, 2), rank(1, 2)])
    with pytest.raises(ValueError, match=r"ranks are \[1, 0\] in the order given"):
        check_group([rank(1, 2), rank(0, 2)])
    with pytest.raises(ValueError, match=r"ranks are \[0, 0\]"):
        check_group([rank(0, 2), rank(0, 2)])
    with pytest.raises(ValueError, match="tensor-parallel size of \\[2\\]"):
        check_group([rank(0, 2)])  # half a group


@pytest.mark.parametrize("field, value", [("model_id", "other"), ("model_path", "/other"), ("vocab_size", 99),
                                          ("max_model_len", 128), ("block_size", 32)])
def test_one_model_one_configuration(field: str, value: object):
    with pytest.raises(ValueError, match=f"rank 1 serves {field}="):
        check_group([rank(0, 2), replace(rank(1, 2), **{field: value})])
