"""Where a step's time goes in `kvmesh serve`: a single stream's output token, or
with --concurrency N a step of N streams.

Starts `kvmesh serve` (its four processes), sends --requests short chat completions, --concurrency
sessions each sending its share one after another (greedy, EOS ignored, --max-tokens each), and
splits the time per engine step from the services' own metrics (deltas over the run; a run is mostly decode steps, the one
prefill step per request is included, which makes "between steps" slightly negative) and the client's clock:

  model forward      the worker's forward pass (kvmesh_worker_forward_seconds)
  logits + sampling  the rest of the worker's execute_model: inputs, LM head, sampler, outputs
  worker servicer    the worker's handling of a step around execute_model (proto <-> core)
  step transport     the engine's step round trip less the worker's handling (the step channel, codec)
  engine step        the engine's step less its RPC: schedule() and update_from_output()
  between steps      the engine's inter-token latency less its step: its loop's own wait
  to the client      the client's TPOT less the engine's inter-token latency (processor, gateway, HTTP)

With --variant NAME=ENV (e.g. --variant omp1=OMP_NUM_THREADS=1) the run is repeated with those
environment variables, the runs alternating A B B A.

    .venv/bin/python -m loadtests.token_time --requests 4 --max-tokens 128
    .venv/bin/python -m loadtests.token_time --variant omp1=OMP_NUM_THREADS=1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from collections import defaultdict

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtests.serve_process import start_serve, stop_serve
from loadtests.serving_client import Endpoint, RequestResult, send
from loadtests.serving_targets import VLLM_EXTRAS

ROWS = ("model forward", "logits + sampling", "worker servicer", "step transport", "engine step",
        "between steps", "to the client")


def scrape(url: str) -> dict[str, float]:
    """The _sum and _count (and _total) samples of a /metrics page, summed over their labels."""
    values: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            if sample.name.endswith(("_sum", "_count", "_total")):
                key = sample.name
                if sample.labels.get("grpc_method"):
                    key += ":" + sample.labels["grpc_method"]
                values[key] += sample.value
    return values


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


async def stream(url: str, requests: int, max_tokens: int, concurrency: int = 1) -> list[RequestResult]:
    """`requests` chat completions, `concurrency` sessions each sending its share one after another."""
    sessions = [range(c, requests, concurrency) for c in range(concurrency)]
    done = await asyncio.gather(*(session(url, numbers, max_tokens) for numbers in sessions))
    return [result for results in done for result in results]


async def session(url: str, numbers: range, max_tokens: int) -> list[RequestResult]:
    endpoint = Endpoint(url, "smollm2", VLLM_EXTRAS)
    results = []
    async with httpx.AsyncClient(timeout=None) as client:
        for i in numbers:
            messages = [{"role": "user", "content": f"Question {i}: tell me about the history of the number {i}."}]
            result = await send(client, endpoint, messages, max_tokens, timeout=300)
            if result.error:
                raise RuntimeError(result.error)
            results.append(result)
    return results


def run(flags: list[str], env: dict[str, str], requests: int, max_tokens: int, concurrency: int) -> dict[str, float]:
    """ms per engine step in each row of ROWS (at concurrency 1 about one output token each), plus the
    client's mean TPOT ("tpot")."""
    proc, ready, _ = start_serve(flags, env=env)
    try:
        api = ready["api"].removesuffix("/v1")
        services = ready["services"]
        worker_url, engine_url = services["worker"]["metrics"], services["engine"]["metrics"]
        asyncio.run(stream(api, 1, 8))  # warm-up
        w0, e0 = scrape(worker_url), scrape(engine_url)
        results = asyncio.run(stream(api, requests, max_tokens, concurrency))
        w1, e1 = scrape(worker_url), scrape(engine_url)
    finally:
        stop_serve(proc)
    steps = delta(e0, e1, "kvmesh_engine_step_seconds_count")
    ms = {name: 1e3 * delta(*pair, metric) / steps for name, pair, metric in (
        ("forward", (w0, w1), "kvmesh_worker_forward_seconds_sum"),
        ("execute", (w0, w1), "kvmesh_worker_execute_seconds_sum"),
        ("handling", (w0, w1), "kvmesh_worker_step_seconds_sum"),
        ("rpc", (e0, e1), "kvmesh_engine_step_rpc_seconds_sum"),
        ("step", (e0, e1), "kvmesh_engine_step_seconds_sum"),
    )}
    # The engine's inter-token latency counts one fewer gap per request than tokens.
    itl = 1e3 * delta(e0, e1, "vllm:inter_token_latency_seconds_sum") / delta(
        e0, e1, "vllm:inter_token_latency_seconds_count")  # ~ a step at any concurrency
    tpot = 1e3 * statistics.mean(r.tpot for r in results)
    return {
        "model forward": ms["forward"],
        "logits + sampling": ms["execute"] - ms["forward"],
        "worker servicer": ms["handling"] - ms["execute"],
        "step transport": ms["rpc"] - ms["handling"],
        "engine step": ms["step"] - ms["rpc"],
        "between steps": itl - ms["step"],
        "to the client": tpot - itl,
        "tpot": tpot,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=1, help="sessions in flight")
    parser.add_argument("--variant", action="append", default=[], help="NAME=VAR=VALUE[,VAR=VALUE]")
    parser.add_argument("--flags", default="--kv-cache-memory 256MiB", help="kvmesh serve's flags")
    args = parser.parse_args()
    variants: dict[str, dict[str, str]] = {"default": {}}
    for spec in args.variant:
        name, _, assignments = spec.partition("=")
        variants[name] = dict(a.split("=", 1) for a in assignments.split(","))
    order = list(variants) + list(reversed(variants)) if len(variants) > 1 else ["default"]
    runs: dict[str, list[dict[str, float]]] = defaultdict(list)
    for name in order:
        runs[name].append(run(args.flags.split(), variants[name], args.requests, args.max_tokens, args.concurrency))
        print(f"token_time: {name}: TPOT {runs[name][-1]['tpot']:.1f} ms", flush=True)
    print(f"\nms per engine step, {args.requests} requests x {args.max_tokens} tokens at concurrency {args.concurrency} "
          f"(each cell: the runs of that variant, in order); load average {os.getloadavg()[0]:.1f} after")
    print("| | " + " | ".join(variants) + " |\n| --- |" + " ---: |" * len(variants))
    for row in (*ROWS, "tpot"):
        cells = (" / ".join(f"{r[row]:.1f}" for r in runs[name]) for name in variants)
        print(f"| {'client TPOT (mean)' if row == 'tpot' else row} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
