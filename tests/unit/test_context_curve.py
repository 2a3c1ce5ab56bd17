"""The context-length curve's bookkeeping: each prompt length's prefill rate is the prompt over the
median time to first token, each target's best run counts, shares are of the target's own rate at
the first length, a run with a failed request gives no rate, and llama-server gets one slot with
room for the longest prompt."""

from __future__ import annotations

import math
from argparse import Namespace
from pathlib import Path

from loadtests.context_curve import PROMPT_MARGIN, build_parser, report
from loadtests.serving_bench import Summary
from loadtests.serving_scenarios import ScenarioLengths, build_sessions
from loadtests.serving_targets import ServerConfig, server_command
from services.processor.tokenizer import load_tokenizer
from services.worker.loader import resolve_model


def run(target: str, length: int, ttft_ms: float, ok: int = 2) -> Summary:
    nan2, nan3 = (math.nan,) * 2, (math.nan,) * 3
    return Summary(target, f"{length} tokens", "c=1", 2, ok, 1.0, 1.0, 1.0, (ttft_ms, math.nan, math.nan), nan3,
                   nan2, nan2, 0, None, float(length))


def test_rates_best_runs_shares_and_ratio(tmp_path: Path):
    args = Namespace(lengths=[1000, 8000], model="smollm2", dtype="auto", api="chat", requests=2, threads=2)
    config = ServerConfig("smollm2", "auto", "cpu", 2**30, 1, 2048, 60.0, tmp_path, llama_file_type="q8_0")
    summaries = [run("kvmesh #1", 1000, 2000.0), run("kvmesh #1", 8000, 40000.0),  # 500 and 200 tok/s
                 run("llama-server #1", 1000, 4000.0), run("llama-server #1", 8000, 80000.0),  # 250, 100
                 run("llama-server #2", 1000, 5000.0), run("llama-server #2", 8000, 100000.0, ok=1),
                 run("kvmesh #2", 1000, 2500.0), run("kvmesh #2", 8000, 50000.0)]
    rows = [line for line in report(args, config, summaries, {}).splitlines() if line.startswith("| ")]
    assert rows[2] == "| 1000 | 500 | 250 | 200 | 400 | 500, 100% | 250, 100% | 2.00x |"
    # llama-server #2 lost a request at 8,000 tokens: no rate of its own there, the other run counts
    assert rows[3] == "| 8000 | 200 | 100 | - | 160 | 200, 40% | 100, 40% | 2.00x |"
    assert "8000 tokens: llama-server #2: 1 of 2 requests failed" in report(args, config, summaries, {})


def test_llama_server_gets_one_slot_for_the_longest_prompt(tmp_path: Path):
    args = build_parser().parse_args(["--lengths", "1000", "6000"])
    (tmp_path / "llama-build" / "bin").mkdir(parents=True)
    (tmp_path / "llama-build" / "bin" / "llama-server").touch()
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "smollm2-q8_0.gguf").touch()
    config = ServerConfig("smollm2", "auto", "cpu", 2**30, 1, 2048, 60.0, tmp_path, llama_server_dir=tmp_path,
                          llama_file_type=args.llama_file_type, llama_slots=1,
                          llama_slot_tokens=max(args.lengths) + PROMPT_MARGIN)
    command = server_command("llama-server", config, 9005)
    assert command[command.index("-np") + 1] == "1" and command[command.index("-c") + 1] == str(6000 + PROMPT_MARGIN)


def test_the_longest_documents_have_their_length():
    tokenizer = load_tokenizer(resolve_model("smollm2"))
    (session,) = build_sessions("long-prompt", 1, 1, tokenizer, ScenarioLengths(long_prompt_tokens=8000))
    document = session.messages[0]["content"].split("\n\nSummarize")[0]
    assert len(tokenizer.encode(document, add_special_tokens=False)) in range(7990, 8040)
