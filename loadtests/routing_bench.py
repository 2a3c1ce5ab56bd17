"""Fleet routing benchmark: kv-aware routing against round-robin and least-load on a fleet of
engines (2 by default), on the same prompts, side by side in one run.

One redis-server of our own on a free loopback port is the prefix index. For each policy in turn:
FLUSHALL it, start `kvmesh serve --num-engines N --prefix-index <it> --routing <policy>` (fresh engines,
empty KV caches), send --warmup requests, run each scenario at --concurrency, stop it. Every policy
gets the same sessions.

Scenarios (loadtests.serving_scenarios), --num-requests requests each:
    multi-turn      --turns requests per conversation; the first carries a --document-tokens document
                    to summarize, each later one the whole conversation so far, so the engine that
                    served the earlier turns holds most of its prompt and any other one recomputes it
    shared-prefix   single requests, each with one of --system-prompts distinct system prompts (taken
                    in turn, --system-prompt-tokens each) and a short question of its own

Columns, per policy:
    req/s, out tok/s    completed requests and their output tokens over the run's wall time
    TTFT ms             p50 / p99 over the completed requests (to the first content chunk)
    cache hit           cached prompt tokens / prompt tokens, summed over the completed requests, both
                        from each response's usage (prompt_tokens_details.cached_tokens)
    routing ms          p50 / p99 of the processor's kvmesh_router_seconds over the run: the difference
                        of a scrape before and one after, interpolated linearly within the bucket that
                        holds the rank (loadtests.router_scrape), so an estimate between bucket bounds
    prediction          requests whose predicted cached tokens were within one block of the engine's
                        num_cached_tokens: 1 - kvmesh_router_mispredictions / requests checked; only a
                        policy that predicts (kv-aware) has it
    decisions           kvmesh_router_decisions_total over the run, by reason

Targets (the project's), printed met or not: kv-aware TTFT p50 at least 2x better than round-robin's on
multi-turn; routing p99 under 2 ms with Redis on loopback; predictions within one block for >= 95 % of
requests. A processor without the router's metrics gets "n/a" in those columns. Bounded: --timeout per
request, --max-duration per run, --startup-timeout per `kvmesh serve`.

    .venv/bin/python -m loadtests.routing_bench --json routing.json   # the published numbers (a quiet machine)
    .venv/bin/python -m loadtests.routing_bench --num-requests 4 --turns 2 --max-tokens 8 --warmup 1 \\
        --system-prompts 2 --document-tokens 200 --system-prompt-tokens 100 --concurrency 2 --threads 1  # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import redis

from loadtests.router_scrape import RouterScrape
from loadtests.serve_process import start_serve, stop_serve
from loadtests.serving_bench import Run, Summary, command_line, format_ms, machine, notes, summarize, warm_up
from loadtests.serving_client import Endpoint, Load, LoadResult, run_load
from loadtests.serving_scenarios import ScenarioLengths, build_sessions
from loadtests.serving_targets import VLLM_EXTRAS, TargetUnavailable, served_model
from services.common.config import parse_bytes
from services.common.processes import free_ports
from services.processor.tokenizer import load_tokenizer
from services.worker.loader import resolve_model
from tests.redis_server import RedisServer

POLICIES = ("kv-aware", "round-robin", "least-load")
SCENARIOS = ("multi-turn", "shared-prefix")
TTFT_SPEEDUP_TARGET = 2.0  # round-robin's TTFT p50 / kv-aware's, multi-turn
ROUTING_P99_TARGET_MS = 2.0
PREDICTION_TARGET = 0.95
SCRAPE_TIMEOUT = 10.0  # seconds


class Row(NamedTuple):
    """One policy on one scenario."""

    policy: str
    summary: Summary
    ttft: tuple[float, float]  # ms, p50 p99
    hit_rate: float  # cached prompt tokens / prompt tokens; nan without completed requests
    router: RouterScrape | None  # the run's difference; None: no scrape (the note says why)

    def to_json(self) -> dict[str, Any]:
        router = self.router if self.router is not None and self.router.exported else None
        return {"policy": self.policy, **self.summary._asdict(), "ttft_p50_p99_ms": self.ttft,
                "cache_hit_rate": self.hit_rate,
                "routing_p50_p99_ms": None if router is None else [router.routing_seconds(q) * 1e3 for q in (50, 99)],
                "prediction_accuracy": None if router is None else router.accuracy,
                "predictions": None if router is None else router.predictions,
                "decisions": None if router is None else {f"{p}/{r}": n for (p, r), n in router.decisions.items()}}


def hit_rate(result: LoadResult) -> float:
    done = [r for r in result.requests if r.ok]
    prompt = sum(r.prompt_tokens for r in done)
    return sum(r.cached_tokens for r in done) / prompt if prompt else math.nan


def scrape(url: str, scrape_notes: list[str]) -> RouterScrape | None:
    try:
        return RouterScrape.fetch(url, SCRAPE_TIMEOUT)
    except OSError as exc:
        scrape_notes.append(f"- the processor's metrics at {url} could not be read: {type(exc).__name__}: {exc}")
        return None


async def bench_policy(policy: str, ready: dict[str, Any], runs: Sequence[Run], args: argparse.Namespace,
                       scrape_notes: list[str]) -> list[Row]:
    url = ready["api"].removesuffix("/v1")
    endpoint = Endpoint(url, served_model(url), VLLM_EXTRAS)
    metrics_url = ready["services"]["processor"]["metrics"]
    await warm_up(endpoint, args.warmup, args)
    rows = []
    for run in runs:
        before = scrape(metrics_url, scrape_notes)
        result = await run_load(endpoint, run.sessions, run.load, args.max_tokens, args.timeout, args.max_duration)
        after = scrape(metrics_url, scrape_notes)
        summary = summarize(policy, run, result, args.max_tokens)
        ttft = summary.ttft[0], summary.ttft[2]
        router = after.since(before) if before is not None and after is not None else None
        rows.append(Row(policy, summary, ttft, hit_rate(result), router))
        print(f"routing_bench: {policy} {run.scenario}: {summary.ok}/{summary.requests} ok in {summary.duration:.1f}s, "
              f"cache hit {rows[-1].hit_rate:.1%}", file=sys.stderr, flush=True)
    return rows


# ----------------------------------------------------------------------------- the report


def _router_cells(router: RouterScrape | None) -> list[str]:
    if router is None or not router.exported:
        return ["n/a", "n/a", "n/a"]
    latency = " / ".join("-" if math.isnan(v) else f"{v:.2f}" for v in (router.routing_seconds(q) * 1e3
                                                                         for q in (50, 99)))
    accuracy = "-" if router.accuracy is None else f"{router.accuracy:.1%} of {router.predictions:.0f}"
    decisions = ", ".join(f"{reason} {n:.0f}" for (_, reason), n in sorted(router.decisions.items())) or "-"
    return [latency, accuracy, decisions]


def table(rows: Sequence[Row]) -> str:
    header = ["policy", "requests", "req/s", "out tok/s", "TTFT ms p50 / p99", "cache hit", "routing ms p50 / p99",
              "prediction within 1 block", "decisions", "errors"]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(["---"] + ["---:"] * 7 + ["---", "---:"]) + " |"]
    for row in rows:
        s = row.summary
        hit = "-" if math.isnan(row.hit_rate) else f"{row.hit_rate:.1%}"
        cells = [row.policy, str(s.requests), f"{s.request_rate:.2f}", f"{s.output_rate:.1f}",
                 " / ".join(map(format_ms, row.ttft)), hit, *_router_cells(row.router), str(s.requests - s.ok)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def targets(rows: Sequence[Row]) -> list[str]:
    lines = []
    by_key = {(r.policy, r.summary.scenario): r for r in rows}
    kv, rr = by_key.get(("kv-aware", "multi-turn")), by_key.get(("round-robin", "multi-turn"))
    if kv is not None and rr is not None and kv.ttft[0] > 0 and not math.isnan(kv.ttft[0] + rr.ttft[0]):
        speedup = rr.ttft[0] / kv.ttft[0]
        lines.append(f"- TTFT p50, multi-turn, round-robin / kv-aware: {speedup:.2f}x "
                     f"(target >= {TTFT_SPEEDUP_TARGET:g}x: {_verdict(speedup >= TTFT_SPEEDUP_TARGET)})")
    for row in rows:
        if row.policy != "kv-aware":
            continue
        where = f"kv-aware {row.summary.scenario}"
        if row.router is None or not row.router.exported:
            lines.append(f"- routing p99 and prediction, {where}: n/a (no kvmesh_router_* metrics from the processor)")
            continue
        p99 = row.router.routing_seconds(99) * 1e3
        if not math.isnan(p99):
            lines.append(f"- routing p99, {where}: {p99:.2f} ms (target < {ROUTING_P99_TARGET_MS:g} ms: "
                         f"{_verdict(p99 < ROUTING_P99_TARGET_MS)})")
        accuracy = row.router.accuracy
        lines.append(f"- predictions within one block, {where}: "
                     + ("none checked" if accuracy is None else
                        f"{accuracy:.1%} of {row.router.predictions:.0f} (target >= {PREDICTION_TARGET:.0%}: "
                        f"{_verdict(accuracy >= PREDICTION_TARGET)})"))
    return lines


def report(args: argparse.Namespace, rows: Sequence[Row], unavailable: dict[str, str], scrape_notes: list[str]) -> str:
    threads = args.threads if args.threads is not None else "torch default"
    parts = [f"Routing benchmark: {args.num_engines} engines, prefix index: redis-server on loopback; "
             f"{args.num_requests} requests per scenario at concurrency {args.concurrency}, {args.max_tokens} "
             f"output tokens each, EOS ignored, greedy; model {args.model}, {args.dtype} on {args.device}, KV cache "
             f"{args.kv_cache_memory / 2**30:g} GiB per engine; server threads: {threads}. Routing percentiles are "
             f"interpolated within the buckets of kvmesh_router_seconds."]
    for scenario in dict.fromkeys(r.summary.scenario for r in rows):
        detail = (f"{args.turns} turns, a {args.document_tokens}-token document first" if scenario == "multi-turn"
                  else f"{args.system_prompts} system prompts of {args.system_prompt_tokens} tokens")
        parts.append(f"### {scenario} ({detail})\n\n" + table([r for r in rows if r.summary.scenario == scenario]))
    blocks = [targets(rows), notes([r.summary for r in rows], args.max_tokens), scrape_notes]
    parts += ["\n".join(block) for block in blocks if block]
    parts += [f"{policy} not run: {reason}" for policy, reason in unavailable.items()]
    return "\n\n".join(parts)


# ----------------------------------------------------------------------------- the command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtests.routing_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", "--policy", nargs="+", default=list(POLICIES), choices=POLICIES,
                        help="one `kvmesh serve` each, one after another, on the same prompts")
    parser.add_argument("--scenarios", "--scenario", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--concurrency", type=int, default=4, help="sessions in flight")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per scenario (multi-turn: "
                        "num-requests / turns sessions)")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens of every request (EOS ignored)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take")
    parser.add_argument("--max-duration", type=float, default=1200.0, help="seconds a scenario may take")
    parser.add_argument("--warmup", type=int, default=2, help="requests sent to each fleet before its runs")
    group = parser.add_argument_group("workloads")
    group.add_argument("--turns", type=int, default=4, help="requests per multi-turn conversation")
    group.add_argument("--document-tokens", type=int, default=800, help="the document opening each conversation")
    group.add_argument("--system-prompts", type=int, default=4, help="distinct shared-prefix system prompts")
    group.add_argument("--system-prompt-tokens", type=int, default=500)
    group = parser.add_argument_group("the fleet (every policy gets the same)")
    group.add_argument("--num-engines", type=int, default=2)
    group.add_argument("--model", default="smollm2", help="model name, Hugging Face folder or GGUF file")
    group.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    group.add_argument("--device", default="cpu", help="cpu, cuda")
    group.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("1GiB"), help="per engine")
    group.add_argument("--max-num-seqs", type=int, default=128)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--heartbeat-ttl", type=float, default=None,
                       help="`kvmesh serve --heartbeat-ttl` (default: its own)")
    group.add_argument("--threads", type=int, default=None,
                       help="OMP_NUM_THREADS of every service (default: torch's own); 1 steadies a shared machine")
    group.add_argument("--startup-timeout", type=float, default=600.0, help="seconds the fleet may take to start")
    group.add_argument("--pin-processor", action="store_true",
                       help="give the processor and the gateway CPU 0 and the engines and workers the other CPUs "
                            "(Linux affinity of every thread), as pods of their own would have: routing latency "
                            "without the wait for a core the workers hold")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    return parser


def pin(ready: dict) -> str:
    """Front services (processor, gateway) on CPU 0, engines and workers on the others; every thread
    of each (threads started later inherit their creator's CPUs). Returns what was done, for the report."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("routing_bench: --pin-processor needs at least 2 CPUs")
    front, back = {cpus[0]}, set(cpus[1:])
    for name, service in ready["services"].items():
        target = front if name in ("processor", "gateway") else back
        for task in Path(f"/proc/{service['pid']}/task").iterdir():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(task.name), target)
    return f"processor and gateway on CPU {cpus[0]}, engines and workers on CPUs {sorted(back)}"


def check_args(args: argparse.Namespace) -> None:
    positive = {"--concurrency": args.concurrency, "--num-requests": args.num_requests, "--max-tokens": args.max_tokens,
                "--turns": args.turns, "--system-prompts": args.system_prompts, "--num-engines": args.num_engines,
                "--system-prompt-tokens": args.system_prompt_tokens, "--document-tokens": args.document_tokens,
                "--timeout": args.timeout, "--max-duration": args.max_duration,
                "--startup-timeout": args.startup_timeout}
    wrong = [f"{flag} {value}" for flag, value in positive.items() if not value > 0]
    if args.warmup < 0:
        wrong.append(f"--warmup {args.warmup}")
    if wrong:
        raise SystemExit(f"routing_bench: these must be positive (--warmup: not negative): {', '.join(wrong)}")


def plan_runs(args: argparse.Namespace) -> list[Run]:
    """Each scenario once, its sessions built once for every policy."""
    tokenizer = load_tokenizer(resolve_model(args.model))
    lengths = ScenarioLengths(shared_prefix_tokens=args.system_prompt_tokens, turns=args.turns,
                              document_tokens=args.document_tokens, system_prompts=args.system_prompts)
    load = Load(concurrency=args.concurrency)
    return [Run(number, scenario, load, build_sessions(scenario, args.num_requests, number, tokenizer, lengths))
            for number, scenario in enumerate(dict.fromkeys(args.scenarios), start=1)]


def serve_flags(policy: str, index_url: str, args: argparse.Namespace) -> list[str]:
    flags = ["--model", args.model, "--dtype", args.dtype, "--device", args.device, "--port", str(free_ports(1)[0]),
             "--num-engines", str(args.num_engines), "--prefix-index", index_url, "--routing", policy,
             "--kv-cache-memory", str(args.kv_cache_memory), "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--startup-timeout", str(args.startup_timeout), "--no-access-log"]
    return flags + (["--heartbeat-ttl", str(args.heartbeat_ttl)] if args.heartbeat_ttl is not None else [])


def flush(index_url: str) -> None:
    """Empty the prefix index, so that a policy finds nothing the previous fleet published."""
    client = redis.Redis.from_url(index_url, socket_timeout=SCRAPE_TIMEOUT)
    try:
        client.flushall()
    finally:
        client.close()


def bench_policies(args: argparse.Namespace, runs: Sequence[Run], index_url: str, unavailable: dict[str, str],
                   scrape_notes: list[str]) -> list[Row]:
    env = {} if args.threads is None else {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    rows: list[Row] = []
    for policy in dict.fromkeys(args.policies):
        flush(index_url)
        print(f"routing_bench: starting kvmesh serve --routing {policy}", file=sys.stderr, flush=True)
        try:
            proc, ready, log = start_serve(serve_flags(policy, index_url, args), args.startup_timeout, env)
        except RuntimeError as exc:
            unavailable[policy] = str(exc)
            continue
        if args.pin_processor:
            scrape_notes.append(f"- {policy}: {pin(ready)}")
        try:
            rows += asyncio.run(bench_policy(policy, ready, runs, args, scrape_notes))
        except TargetUnavailable as exc:
            unavailable[policy] = f"{exc} (its log: {log})"
        finally:
            stop_serve(proc)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    check_args(args)
    runs = plan_runs(args)
    load_before, started_at = os.getloadavg()[0], time.time()
    unavailable: dict[str, str] = {}
    scrape_notes: list[str] = []
    index = RedisServer().start()
    try:
        rows = bench_policies(args, runs, index.url, unavailable, scrape_notes)
    finally:
        index.close()

    print("\n" + report(args, rows, unavailable, scrape_notes))
    print(f"\nMachine: {machine()}. Load average (1 min) {load_before:.1f} before, {os.getloadavg()[0]:.1f} "
          f"after; {time.time() - started_at:.0f}s in all.")
    print(f"Command: {command_line(argv, 'loadtests.routing_bench')}")
    if args.json:
        args.json.write_text(json.dumps({"command": command_line(argv, "loadtests.routing_bench"),
                                         "machine": machine(), "rows": [r.to_json() for r in rows],
                                         "unavailable": unavailable}, indent=1))
    return 0 if rows and not unavailable else 1


if __name__ == "__main__":
    sys.exit(main())
