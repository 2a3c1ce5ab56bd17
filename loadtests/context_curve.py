"""The context-length curve: one long prompt's prefill rate (prompt tokens over its time to first
token) at several lengths, kvmesh and llama-server side by side in one run.

For each target in turn (A B B A by default: alternate the servers, so drift on a shared machine
hits both), start its server, warm it up, then for each length send --requests prompts of that many
tokens one at a time (a document of the long-prompt scenario, each with a tag of its own so nothing
comes from a prefix cache), each asking for one output token. llama-server gets one slot with room
for the longest prompt. The table gives each run's median rate, each target's best rate over its
runs, the ratio of the best rates, and each target's rate as a share of its rate at the shortest
length: how much of its short-prompt speed a long prompt keeps.

    .venv/bin/python -m loadtests.context_curve --model smollm2 --llama-file-type q8_0
    .venv/bin/python -m loadtests.context_curve --model gemma3-270m --api completions --llama-file-type model
    .venv/bin/python -m loadtests.context_curve --targets kvmesh --lengths 1000 2000 --requests 1   # a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from loadtests.serving_bench import Run, Summary, bench_targets, command_line, machine
from loadtests.serving_client import Load
from loadtests.serving_scenarios import ScenarioLengths, build_sessions
from loadtests.serving_targets import DEFAULT_ANCHOR_DIR, ServerConfig, llama_gguf
from services.common.config import parse_bytes
from services.processor.tokenizer import load_tokenizer
from services.worker.loader import resolve_model

PROMPT_MARGIN = 256  # llama-server's context beyond the longest prompt: the tag, the template, the output


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtests.context_curve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", "--target", nargs="+",
                        default=["kvmesh", "llama-server", "llama-server", "kvmesh"],
                        choices=["kvmesh", "inprocess", "llama-server"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000, 8000],
                        help="document tokens of the prompts, the first the baseline of the shares")
    parser.add_argument("--requests", type=int, default=2, help="prompts per length and run, one at a time")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--api", default="chat", choices=["chat", "completions"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("1GiB"))
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--llama-server-dir", type=Path, default=DEFAULT_ANCHOR_DIR)
    parser.add_argument("--llama-file-type", default="q8_0", choices=["f16", "f32", "bf16", "q8_0", "q4_1", "model"])
    return parser


def plan_runs(args: argparse.Namespace) -> list[Run]:
    tokenizer = load_tokenizer(resolve_model(args.model))
    return [Run(number, f"{length} tokens", Load(concurrency=1),
                build_sessions("long-prompt", args.requests, number, tokenizer,
                               ScenarioLengths(long_prompt_tokens=length)))
            for number, length in enumerate(args.lengths, start=1)]


def rate(summary: Summary) -> float:
    """Prompt tokens per second of prefill: the mean prompt over the median time to first token."""
    return summary.prompt_tokens / (summary.ttft[0] / 1e3)


def report(args: argparse.Namespace, config: ServerConfig, summaries: Sequence[Summary],
           unavailable: dict[str, str]) -> str:
    labels = list(dict.fromkeys(s.target for s in summaries))
    by = {(s.target, s.scenario): s for s in summaries}
    targets = list(dict.fromkeys(label.partition(" #")[0] for label in labels))
    header = ["prompt tokens", *[f"{label} tok/s" for label in labels], *[f"{t} best, share of first" for t in targets]]
    if {"kvmesh", "llama-server"} <= set(targets):
        header.append("kvmesh ÷ llama-server")
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(["---:"] * len(header)) + " |"]
    first_best: dict[str, float] = {}
    problems = []
    for length in args.lengths:
        scenario = f"{length} tokens"
        runs = {label: by.get((label, scenario)) for label in labels}
        for label, s in runs.items():
            if s is not None and s.incomplete():
                problems.append(f"- {scenario}: {s.incomplete()}")
        rates = {label: rate(s) for label, s in runs.items() if s is not None and not s.incomplete()}
        best = {t: max((r for label, r in rates.items() if label.partition(" #")[0] == t), default=float("nan"))
                for t in targets}
        for t in targets:
            first_best.setdefault(t, best[t])
        prompt = statistics.mean(s.prompt_tokens for s in runs.values() if s is not None)
        cells = [f"{prompt:.0f}", *[f"{rates[label]:.0f}" if label in rates else "-" for label in labels],
                 *[f"{best[t]:.0f}, {best[t] / first_best[t]:.0%}" for t in targets]]
        if "kvmesh ÷ llama-server" in header:
            cells.append(f"{best['kvmesh'] / best['llama-server']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    gguf = f"; llama-server: {llama_gguf(config).name}, one slot" if "llama-server" in targets else ""
    parts = [f"Context-length curve: model {args.model}, {args.dtype}, {args.api} API; {args.requests} prompt(s) per "
             f"length and run, one at a time, one output token; server threads: {args.threads}{gguf}.",
             "\n".join(lines)]
    parts += ["\n".join(problems)] if problems else []
    parts += [f"{target} not run: {reason}" for target, reason in unavailable.items()]
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.requests < 1 or min(args.lengths) < 1:
        raise SystemExit("context_curve: --requests and --lengths must be positive")
    runs = plan_runs(args)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="context_curve-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    config = ServerConfig(args.model, args.dtype, "cpu", args.kv_cache_memory, 1, args.max_num_batched_tokens,
                          args.startup_timeout, log_dir, threads=args.threads, llama_server_dir=args.llama_server_dir,
                          llama_file_type=args.llama_file_type, llama_slots=1,
                          llama_slot_tokens=max(args.lengths) + PROMPT_MARGIN)
    bench = argparse.Namespace(warmup=1, max_tokens=1, timeout=args.timeout, max_duration=args.timeout * args.requests,
                               api=args.api)
    summaries, unavailable = bench_targets(args.targets, config, runs, bench)
    print("\n" + report(args, config, summaries, unavailable))
    print(f"\nMachine: {machine()}\n\nCommand: `{command_line(argv, 'loadtests.context_curve')}`")
    return 0 if summaries and not unavailable else 1


if __name__ == "__main__":
    raise SystemExit(main())
