"""Disaggregated prefill/decode against colocated engines, long prompts, at equal worker
count: `kvmesh serve --prefill-engines 1 --decode-engines 1` against `kvmesh serve --num-engines 2`,
the same requests to each.

Scenario: loadtests.serving_scenarios' long-prompt (a --prompt-tokens document to summarize, distinct
per request, so no prefix is cached), --num-requests requests at --concurrency, --max-tokens tokens
each (ignore_eos). P/D runs with --prefill-threshold 256: every such prompt is prefilled on the
prefill engine. Columns: completed req/s and output tok/s over the run's wall time, TTFT and ITL
p50 / p99 (ms), and for P/D the KV transfers over the run (the decode engine's kvmesh_kv_transfer_*):
count, MiB and GB/s (bytes over the summed transfer seconds, from P's first token to the blocks'
arrival on D: the receive waits for P's send to start).

    .venv/bin/python -m loadtests.pd_bench                      # 8 requests of ~1,200 tokens, c=2
"""

from __future__ import annotations

import argparse
import asyncio
import urllib.request

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtests.serve_process import start_serve, stop_serve
from loadtests.serving_bench import command_line, machine, percentile
from loadtests.serving_client import Endpoint, RequestResult, send
from loadtests.serving_scenarios import ScenarioLengths, build_sessions
from loadtests.serving_targets import VLLM_EXTRAS, served_model
from services.common.processes import free_ports
from services.processor.tokenizer import load_tokenizer
from services.worker.loader import resolve_model

CONFIGS = {"colocated 2": ["--num-engines", "2"],
           "P/D 1+1": ["--prefill-engines", "1", "--decode-engines", "1", "--prefill-threshold", "256"]}


def scrape(url: str) -> dict[str, float]:
    """name{labels} -> value, summed over labels (enough for the counters read here)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(urllib.request.urlopen(url, timeout=5).read().decode()):
        for sample in family.samples:
            if sample.name.startswith("kvmesh_kv_transfer"):
                key = f"{sample.name}{{{sample.labels.get('direction', '')}}}"
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


async def run(endpoint: Endpoint, messages: list, args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    gate = asyncio.Semaphore(args.concurrency)
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(timeout=None) as client:
        async def one(m) -> RequestResult:
            async with gate:
                return await send(client, endpoint, m, args.max_tokens, args.timeout)
        start = loop.time()
        results = await asyncio.gather(*(one(m) for m in messages))
        return list(results), loop.time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=1200)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    args = parser.parse_args()
    model_path = resolve_model("smollm2", None)
    tokenizer = load_tokenizer(model_path)
    print(f"machine: {machine()}")
    print(f"command: {command_line(__import__('sys').argv[1:], 'loadtests.pd_bench')}")
    print("| config | req/s | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | KV transfers |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for run_index, (name, flags) in enumerate(CONFIGS.items()):
        port = free_ports(1)[0]
        proc, ready, log = start_serve(["--model", str(model_path), "--port", str(port), "--kv-cache-memory",
                                        args.kv_cache_memory, *flags])
        try:
            url = f"http://127.0.0.1:{port}"
            endpoint = Endpoint(url, served_model(url), VLLM_EXTRAS)
            sessions = build_sessions("long-prompt", args.num_requests + 1, run_index, tokenizer,
                                      ScenarioLengths(long_prompt_tokens=args.prompt_tokens))
            asyncio.run(run(endpoint, [sessions[-1].messages], args))  # warm-up (and the pair's rendezvous)
            decode = ready["services"].get("engine-decode-0", {}).get("metrics")
            before = scrape(decode) if decode else {}
            results, seconds = asyncio.run(run(endpoint, [s.messages for s in sessions[:-1]], args))
            after = scrape(decode) if decode else {}
        finally:
            stop_serve(proc)
        done = [r for r in results if r.ok]
        ttft = [r.ttft * 1e3 for r in done]
        itl = [g * 1e3 for r in done for g in r.itl]
        transfers = "n/a"
        if decode:
            count = after["kvmesh_kv_transfers_total{received}"] - before.get("kvmesh_kv_transfers_total{received}", 0)
            nbytes = after["kvmesh_kv_transfer_bytes_total{received}"] - before.get(
                "kvmesh_kv_transfer_bytes_total{received}", 0)
            secs = after["kvmesh_kv_transfer_seconds_sum{received}"] - before.get(
                "kvmesh_kv_transfer_seconds_sum{received}", 0)
            transfers = f"{count:.0f}, {nbytes / 2**20:.0f} MiB, {nbytes / max(secs, 1e-9) / 1e9:.2f} GB/s"
        errors = len(results) - len(done)
        print(f"| {name} | {len(done) / seconds:.2f} | {sum(r.output_tokens for r in done) / seconds:.1f} | "
              f"{percentile(ttft, 50):.0f} / {percentile(ttft, 99):.0f} | {percentile(itl, 50):.0f} / "
              f"{percentile(itl, 99):.0f} | {transfers}{f' ({errors} failed)' if errors else ''} |", flush=True)


if __name__ == "__main__":
    main()
