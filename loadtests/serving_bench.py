"""Serving benchmark: `kvmesh serve` against the same stack in one process and against
`transformers serve --continuous-batching`, on the same model and prompts, side by side in one run.

For each target in turn (loadtests.serving_targets): start its server on a free loopback port, wait
for /health, send --warmup requests (a prompt of their own; transformers serve builds its continuous
batching on the first request), then for each scenario × load run --num-requests streamed chat
completions (loadtests.serving_client) and stop the server. Every request is greedy with
`max_tokens` = --max-tokens and EOS ignored, so every output has the same known length. One
markdown table comes out at the end, with the split/in-process throughput ratio (the project's target:
>= 90 % at concurrency 32), kvmesh against transformers serve, the machine and this command line.

Scenarios (loadtests.serving_scenarios): short-chat, long-prompt (~1,000 tokens), shared-prefix
(~500-token system prompt + short questions), multi-turn (--turns requests per conversation, each
carrying the answers so far). Loads: --concurrency N (N sessions in flight) and/or --rate R (Poisson
arrivals, R sessions/s, seeded by --seed). Bounded: --num-requests per run, --timeout per request,
--max-duration per run, --startup-timeout per server.

Columns: req/s and out tok/s are completed requests and their output tokens over the run's wall time;
TTFT, TPOT (ms per output token after the first), ITL (ms between content chunks, pooled over all
requests) and e2e are p50/p90/p99 over the completed requests; errors counts requests that failed,
timed out or were not sent.

    .venv/bin/python -m loadtests.serving_bench --targets kvmesh inprocess transformers \\
        --scenario short-chat --concurrency 32 --num-requests 128 --max-tokens 64
    .venv/bin/python -m loadtests.serving_bench --targets kvmesh inprocess --scenario short-chat \\
        --concurrency 2 --num-requests 4 --max-tokens 8                    # a smoke run
    .venv/bin/python -m loadtests.serving_bench --target url --url http://127.0.0.1:8000 --rate 2 --num-requests 16
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import transformers

from loadtests.serving_client import Endpoint, Load, LoadResult, run_load
from loadtests.serving_scenarios import SCENARIOS, ScenarioLengths, Session, build_sessions
from loadtests.serving_targets import (DEFAULT_ANCHOR_DIR, LLAMA_SLOT_TOKENS, TARGETS, ServerConfig, TargetUnavailable,
                                      llama_gguf, started)
from services.common.config import parse_bytes
from services.processor.tokenizer import load_tokenizer
from services.worker.loader import resolve_model

RATIO_CONCURRENCY = 32  # where the issue states the split/in-process target
RATIO_TARGET = 0.90
WARMUP_MESSAGES = [{"role": "user", "content": "Warm-up: count from one to twenty in words."}]


class Run(NamedTuple):
    """One scenario under one load; `number` tags its prompts (see loadtests.serving_scenarios)."""

    number: int
    scenario: str
    load: Load
    sessions: list[Session]


class Summary(NamedTuple):
    target: str
    scenario: str
    mode: str
    requests: int
    ok: int
    duration: float  # s
    request_rate: float  # completed requests / s
    output_rate: float  # output tokens of completed requests / s
    ttft: tuple[float, float, float]  # ms, p50 p90 p99
    tpot: tuple[float, float, float]  # ms
    itl: tuple[float, float]  # ms, p50 p99
    e2e: tuple[float, float]  # s, p50 p99
    wrong_length: int  # completed requests whose output was not max_tokens long
    first_error: str | None
    prompt_tokens: float = math.nan  # mean over the completed requests, as their usage reported it

    def incomplete(self) -> str | None:
        """Why this run cannot be held against another: a request that failed or came back short."""
        if self.ok < self.requests:
            return f"{self.target}: {self.requests - self.ok} of {self.requests} requests failed"
        if self.wrong_length:
            return f"{self.target}: {self.wrong_length} answers not at full length"
        return None


PROMPT_TOKENS_TOLERANCE = 0.02  # two sides' mean prompt tokens may differ this much (their chat templates)


def not_comparable(a: Summary, b: Summary) -> str | None:
    """Why a ratio of `a` over `b` would mislead, or None: both sides must have completed every
    request at full length, with the same prompts as each side's tokenizer counts them."""
    reason = a.incomplete() or b.incomplete()
    if reason:
        return reason
    if not (a.prompt_tokens > 0 and b.prompt_tokens > 0):
        return "a side reported no prompt tokens"
    if abs(a.prompt_tokens - b.prompt_tokens) > PROMPT_TOKENS_TOLERANCE * max(a.prompt_tokens, b.prompt_tokens):
        return (f"mean prompt tokens differ by more than {PROMPT_TOKENS_TOLERANCE:.0%}: {a.prompt_tokens:.1f} "
                f"against {b.prompt_tokens:.1f}")
    return None


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(target: str, run: Run, result: LoadResult, max_tokens: int) -> Summary:
    done = [r for r in result.requests if r.ok]
    ttft = [r.ttft * 1e3 for r in done]
    tpot = [r.tpot * 1e3 for r in done if r.tpot is not None]
    itl = [gap * 1e3 for r in done for gap in r.itl]
    e2e = [r.e2e for r in done]
    errors = [r.error for r in result.requests if not r.ok]
    duration = max(result.duration, 1e-9)
    return Summary(
        target, run.scenario, run.load.label, len(result.requests), len(done), result.duration,
        len(done) / duration, sum(r.output_tokens for r in done) / duration,
        tuple(percentile(ttft, q) for q in (50, 90, 99)), tuple(percentile(tpot, q) for q in (50, 90, 99)),
        (percentile(itl, 50), percentile(itl, 99)), (percentile(e2e, 50), percentile(e2e, 99)),
        sum(r.output_tokens != max_tokens for r in done), errors[0] if errors else None,
        sum(r.prompt_tokens for r in done) / len(done) if done else math.nan)


async def warm_up(endpoint: Endpoint, num_requests: int, args: argparse.Namespace) -> None:
    """`num_requests` requests of a prompt of their own, all at once; TargetUnavailable if one fails."""
    if not num_requests:
        return
    warmup = await run_load(endpoint, [Session(WARMUP_MESSAGES)] * num_requests, Load(concurrency=num_requests),
                            args.max_tokens, args.timeout, args.max_duration)
    failed = [r.error for r in warmup.requests if not r.ok]
    if failed:
        raise TargetUnavailable(f"the warm-up failed: {failed[0]}")


async def bench_target(target: str, endpoint: Endpoint, runs: Sequence[Run], args: argparse.Namespace) -> list[Summary]:
    await warm_up(endpoint, args.warmup, args)
    summaries = []
    for run in runs:
        result = await run_load(endpoint, run.sessions, run.load, args.max_tokens, args.timeout, args.max_duration)
        summary = summarize(target, run, result, args.max_tokens)
        summaries.append(summary)
        print(f"serving_bench: {target} {run.scenario} {run.load.label}: {summary.ok}/{summary.requests} ok in "
              f"{summary.duration:.1f}s, {summary.output_rate:.1f} out tok/s", file=sys.stderr, flush=True)
    return summaries


def bench_targets(targets: Sequence[str], config: ServerConfig, runs: Sequence[Run],
                  args: argparse.Namespace) -> tuple[list[Summary], dict[str, str]]:
    """Each target in turn (a target named twice runs twice): started, benched, stopped. Returns the
    summaries and, per target that could not be run, why. `args` as bench_target's, plus api (and
    url, url_api for the url target)."""
    summaries: list[Summary] = []
    unavailable: dict[str, str] = {}
    for target, label in run_labels(targets):
        if target in unavailable:
            continue
        print(f"starting {label} (logs in {config.log_dir})", file=sys.stderr, flush=True)
        try:
            with started(target, config, getattr(args, "url", None), getattr(args, "url_api", "vllm")) as endpoint:
                endpoint = dataclasses.replace(endpoint, api=args.api)
                summaries += asyncio.run(bench_target(label, endpoint, runs, args))
        except TargetUnavailable as exc:
            print(f"{target} not run: {exc}", file=sys.stderr, flush=True)
            unavailable[target] = str(exc)
    return summaries, unavailable


# ----------------------------------------------------------------------------- the report


def format_ms(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def table(summaries: Sequence[Summary], unavailable: dict[str, str]) -> str:
    header = ["target", "scenario", "mode", "requests", "req/s", "out tok/s", "TTFT ms p50 / p90 / p99",
              "TPOT ms p50 / p90 / p99", "ITL ms p50 / p99", "e2e s p50 / p99", "errors"]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(["---"] * 3 + ["---:"] * 8) + " |"]
    for s in summaries:
        e2e = " / ".join("-" if math.isnan(v) else f"{v:.2f}" for v in s.e2e)
        cells = [s.target, s.scenario, s.mode, str(s.requests), f"{s.request_rate:.2f}", f"{s.output_rate:.1f}",
                 " / ".join(map(format_ms, s.ttft)), " / ".join(map(format_ms, s.tpot)),
                 " / ".join(map(format_ms, s.itl)), e2e, str(s.requests - s.ok)]
        lines.append("| " + " | ".join(cells) + " |")
    for target, reason in unavailable.items():
        lines.append(f"| {target} | | | | | | not run: {reason.splitlines()[0]} | | | | |")
    return "\n".join(lines)


def ratios(summaries: Sequence[Summary]) -> list[str]:
    """kvmesh over inprocess (the project's target at concurrency 32) and over transformers, per run."""
    by_key = {(s.target, s.scenario, s.mode): s for s in summaries}
    lines = []
    for other, goal in (("inprocess", f"target >= {RATIO_TARGET:.0%} at c={RATIO_CONCURRENCY}"),
                        ("transformers", "target: kvmesh ahead, > 100%")):
        for s in summaries:
            base = by_key.get((other, s.scenario, s.mode))
            if s.target != "kvmesh" or base is None:
                continue
            reason = not_comparable(s, base)
            if reason:
                lines.append(f"- kvmesh / {other}, {s.scenario} {s.mode}: no ratio ({reason})")
                continue
            ratio = s.output_rate / base.output_rate
            verdict = ""
            if other == "transformers":
                verdict = "met" if ratio > 1 else "NOT met"
            elif s.mode == f"c={RATIO_CONCURRENCY}":
                verdict = "met" if ratio >= RATIO_TARGET else "NOT met"
            lines.append(f"- kvmesh / {other}, out tok/s, {s.scenario} {s.mode}: {ratio:.1%}"
                         + (f" ({goal}: {verdict})" if verdict else ""))
    return lines


# The CPU anchor's goals, kvmesh against llama-server in the same run: (scenario, mode) -> (measure, goal).
# Output tokens/s: kvmesh / llama-server at least the goal; TTFT p50: kvmesh / llama-server at most it.
ANCHOR_GOALS = {("short-chat", "c=1"): ("out tok/s", 0.8), ("short-chat", "c=8"): ("out tok/s", 1.2),
                ("short-chat", "c=32"): ("out tok/s", 1.5), ("long-prompt", "c=8"): ("TTFT p50", 0.5),
                ("shared-prefix", "c=8"): ("out tok/s", 3.0)}


def anchor_ratios(summaries: Sequence[Summary]) -> list[str]:
    """kvmesh over llama-server per run, the k-th run of one paired with the k-th of the other."""
    def split(label: str) -> tuple[str, str]:
        target, _, number = label.partition(" #")
        return target, number or "1"

    anchors = {(split(s.target)[1], s.scenario, s.mode): s for s in summaries if split(s.target)[0] == "llama-server"}
    lines = []
    for s in summaries:
        target, number = split(s.target)
        other = anchors.get((number, s.scenario, s.mode))
        if target != "kvmesh" or other is None:
            continue
        reason = not_comparable(s, other)
        if reason:
            lines.append(f"- kvmesh / llama-server, run {number}, {s.scenario} {s.mode}: no ratio ({reason})")
            continue
        throughput = s.output_rate / other.output_rate if other.output_rate else math.nan
        ttft = s.ttft[0] / other.ttft[0] if other.ttft[0] else math.nan
        measure, goal = ANCHOR_GOALS.get((s.scenario, s.mode), (None, None))
        verdict = ""
        if measure == "TTFT p50":
            verdict = f" (goal TTFT p50 <= {goal}x: {'met' if ttft <= goal else 'NOT met'})"
        elif measure is not None:
            verdict = f" (goal >= {goal}x: {'met' if throughput >= goal else 'NOT met'})"
        lines.append(f"- kvmesh / llama-server, run {number}, {s.scenario} {s.mode}: out tok/s {throughput:.2f}x, "
                     f"TTFT p50 {ttft:.2f}x{verdict}")
    return lines


def notes(summaries: Sequence[Summary], max_tokens: int) -> list[str]:
    lines = []
    for s in summaries:
        if s.wrong_length:
            lines.append(f"- {s.target} {s.scenario} {s.mode}: {s.wrong_length} output(s) not {max_tokens} tokens long")
        if s.first_error:
            lines.append(f"- {s.target} {s.scenario} {s.mode}: {s.requests - s.ok} error(s); the first: "
                         f"{s.first_error}")
    return lines


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return (f"{os.cpu_count()} × {cpu} ({' '.join(simd_flags()) or 'no AVX'}){gpu}; Python "
            f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}")


SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_int8")


def simd_flags() -> list[str]:
    """The CPU's vector extensions that decide which kernels and weight formats are fast on it."""
    try:
        flags = next(line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return [f for f in SIMD_FLAGS if f in flags]


def command_line(argv: Sequence[str], module: str = "loadtests.serving_bench") -> str:
    python = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
    return shlex.join([python, "-m", module, *argv])


# ----------------------------------------------------------------------------- the command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtests.serving_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", "--target", nargs="+", default=["kvmesh", "inprocess", "transformers"],
                        choices=TARGETS, help="run one after another, on the same prompts; a target named twice "
                                              "runs twice (A B B A: alternate the servers), its runs numbered")
    parser.add_argument("--scenarios", "--scenario", nargs="+", default=["short-chat"],
                        choices=[*SCENARIOS, "all"])
    parser.add_argument("--concurrency", type=int, nargs="*", default=[], help="sessions in flight (one run each)")
    parser.add_argument("--rate", type=float, nargs="*", default=[],
                        help="Poisson arrivals, sessions/s (one run each); without both: --concurrency 32")
    parser.add_argument("--seed", type=int, default=0, help="seeds the Poisson arrivals")
    parser.add_argument("--num-requests", type=int, default=128, help="requests per run")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens of every request (EOS ignored)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    parser.add_argument("--max-duration", type=float, default=1800.0, help="seconds a run may take")
    parser.add_argument("--warmup", type=int, default=2, help="requests sent to each server before its runs")
    group = parser.add_argument_group("workloads")
    group.add_argument("--long-prompt-tokens", type=int, default=1000)
    group.add_argument("--shared-prefix-tokens", type=int, default=500)
    group.add_argument("--turns", type=int, default=4, help="requests per multi-turn conversation")
    group = parser.add_argument_group("servers (all targets get the same)")
    group.add_argument("--model", default="smollm2", help="model name, Hugging Face folder or GGUF file")
    group.add_argument("--api", default="chat", choices=["chat", "completions"],
                       help="chat completions, or completions of a plain transcript (a base model without a "
                            "chat template)")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="auto: kvmesh serve's default; float32: its exact one")
    group.add_argument("--device", default="cpu", help="cpu, cuda")
    group.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("1GiB"))
    group.add_argument("--max-num-seqs", type=int, default=128)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                       help="threads of every server: OMP_NUM_THREADS, and llama-server's -t and -tb (default: "
                            "every core); 1 steadies a shared machine")
    group.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a server may take to start")
    group.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a new temporary folder)")
    group.add_argument("--url", default=None, help="the server of --target url, e.g. http://127.0.0.1:8000")
    group.add_argument("--url-api", default="vllm", choices=["vllm", "transformers"],
                       help="how --url makes outputs max_tokens long: vLLM's ignore_eos, or transformers' "
                            "generation_config")
    group = parser.add_argument_group("llama-server (the CPU anchor)")
    group.add_argument("--llama-server-dir", type=Path, default=DEFAULT_ANCHOR_DIR,
                       help="what ../shared/anchors/build-llama-server.sh built")
    group.add_argument("--llama-file-type", default="f16", choices=["f16", "f32", "bf16", "q8_0", "q4_1", "model"],
                       help="the SmolLM2 GGUF of that type, or 'model': the GGUF file --model names (both sides "
                            "then serve the same file)")
    group.add_argument("--llama-slots", type=int, default=32)
    group.add_argument("--llama-repack", default="on", choices=["on", "off"],
                       help="llama.cpp's weight repacking (off where its AMX path dies: Xeon VMs here)")
    parser.add_argument("--json", type=Path, default=None, help="also write the summaries here")
    return parser


def run_labels(targets: Sequence[str]) -> list[tuple[str, str]]:
    """(target, label) in the order given; a target named more than once is labelled `target #k`."""
    counts = {t: targets.count(t) for t in targets}
    seen: dict[str, int] = {}
    out = []
    for target in targets:
        seen[target] = seen.get(target, 0) + 1
        out.append((target, f"{target} #{seen[target]}" if counts[target] > 1 else target))
    return out


def plan_runs(args: argparse.Namespace) -> list[Run]:
    """Every scenario under every load, in that order, each with its prompts built once for all targets."""
    scenarios = list(SCENARIOS) if "all" in args.scenarios else list(dict.fromkeys(args.scenarios))
    loads = [Load(concurrency=c) for c in args.concurrency] + [Load(rate=r, seed=args.seed) for r in args.rate]
    tokenizer = load_tokenizer(resolve_model(args.model))
    lengths = ScenarioLengths(args.long_prompt_tokens, args.shared_prefix_tokens, args.turns)
    runs: list[Run] = []
    for scenario in scenarios:
        for load in loads or [Load(concurrency=RATIO_CONCURRENCY)]:
            number = len(runs) + 1
            runs.append(Run(number, scenario, load,
                            build_sessions(scenario, args.num_requests, number, tokenizer, lengths)))
    return runs


def server_config(args: argparse.Namespace, log_dir: Path) -> ServerConfig:
    return ServerConfig(args.model, args.dtype, args.device, args.kv_cache_memory, args.max_num_seqs,
                        args.max_num_batched_tokens, args.startup_timeout, log_dir, threads=args.threads,
                        llama_server_dir=args.llama_server_dir, llama_file_type=args.llama_file_type,
                        llama_slots=args.llama_slots, llama_repack=args.llama_repack == "on")


def report(args: argparse.Namespace, config: ServerConfig, summaries: Sequence[Summary],
           unavailable: dict[str, str]) -> str:
    threads = args.threads
    parts = [f"Serving benchmark: {args.max_tokens} output tokens per request, EOS ignored, greedy; "
             f"{args.num_requests} requests per run; model {args.model}, {args.dtype} on {args.device}, "
             f"KV cache {args.kv_cache_memory / 2**30:g} GiB; server threads: {threads}"
             + (f"; {args.api} API" if args.api != "chat" else "")
             + (f"; llama-server: {llama_gguf(config).name}, {args.llama_slots} slots of "
                f"{LLAMA_SLOT_TOKENS} tokens, continuous batching, repack {args.llama_repack}" if "llama-server" in args.targets else "") + ".",
             table(summaries, unavailable)]
    parts += ["\n".join(block) for block in (ratios(summaries), anchor_ratios(summaries),
                                              notes(summaries, args.max_tokens)) if block]
    parts += [f"{target} not run: {reason}" for target, reason in unavailable.items()]
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.num_requests < 1 or args.max_tokens < 1 or args.turns < 1:
        raise SystemExit("serving_bench: --num-requests, --max-tokens and --turns must be positive")
    runs = plan_runs(args)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="serving_bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    config = server_config(args, log_dir)

    load_before, started_at = os.getloadavg()[0], time.time()
    summaries, unavailable = bench_targets(args.targets, config, runs, args)

    print("\n" + report(args, config, summaries, unavailable))
    print(f"\nMachine: {machine()}. Load average (1 min) {load_before:.1f} before, {os.getloadavg()[0]:.1f} "
          f"after; {time.time() - started_at:.0f}s in all.")
    print(f"Command: {command_line(argv)}")
    if args.json:
        args.json.write_text(json.dumps({"command": command_line(argv), "machine": machine(),
                                         "summaries": [s._asdict() for s in summaries],
                                         "unavailable": unavailable}, indent=1))
    return 0 if summaries and not unavailable else 1


if __name__ == "__main__":
    sys.exit(main())
