"""The serving benchmark's side-by-side bookkeeping: alternated runs keep their own labels, and each
kvmesh run is held against the llama-server run of the same number, with issue 16's goals."""

from __future__ import annotations

import math

from loadtests.serving_bench import Summary, anchor_ratios, run_labels


def summary(target: str, scenario: str, mode: str, out: float, ttft_p50: float) -> Summary:
    nan3 = (math.nan,) * 3
    return Summary(target, scenario, mode, 8, 8, 1.0, 8.0, out, (ttft_p50, math.nan, math.nan), nan3,
                   (math.nan, math.nan), (math.nan, math.nan), 0, None)


def test_a_target_named_twice_runs_twice_numbered():
    assert run_labels(["kvmesh", "llama-server", "llama-server", "kvmesh"]) == [
        ("kvmesh", "kvmesh #1"), ("llama-server", "llama-server #1"),
        ("llama-server", "llama-server #2"), ("kvmesh", "kvmesh #2")]
    assert run_labels(["kvmesh", "inprocess"]) == [("kvmesh", "kvmesh"), ("inprocess", "inprocess")]


def test_each_kvmesh_run_is_held_against_the_anchor_run_of_its_number():
    lines = anchor_ratios([
        summary("kvmesh #1", "short-chat", "c=8", 120.0, 100.0),
        summary("llama-server #1", "short-chat", "c=8", 100.0, 50.0),
        summary("llama-server #2", "short-chat", "c=8", 200.0, 50.0),
        summary("kvmesh #2", "short-chat", "c=8", 100.0, 25.0),
        summary("kvmesh #1", "long-prompt", "c=8", 10.0, 400.0),
        summary("llama-server #1", "long-prompt", "c=8", 10.0, 1000.0),
    ])
    assert lines == [
        "- kvmesh / llama-server, run 1, short-chat c=8: out tok/s 1.20x, TTFT p50 2.00x (goal >= 1.2x: met)",
        "- kvmesh / llama-server, run 2, short-chat c=8: out tok/s 0.50x, TTFT p50 0.50x (goal >= 1.2x: NOT met)",
        "- kvmesh / llama-server, run 1, long-prompt c=8: out tok/s 1.00x, TTFT p50 0.40x "
        "(goal TTFT p50 <= 0.5x: met)",
    ]
