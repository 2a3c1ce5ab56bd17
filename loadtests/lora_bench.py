"""LoRA serving cost: `kvmesh serve` of the base model against the same server with K adapters, the
requests spread over the adapters, side by side in one run (A B B A: base, adapters, adapters, base).

The adapters are made here with peft over the model's Hugging Face folder: rank --rank on q, k, v,
o, gate, up and down, random A and B (no training: the cost does not depend on the values). The
adapters' server gets --enable-lora --max-loras K, so every step may hold all of them; session i
names adapter i mod K. Both servers get the same prompts (short chats), the same --max-tokens with
EOS ignored, and the same threads. The project's target: the adapters' out tok/s at 8 streams is at
least 80 % of the base model's.

    .venv/bin/python -m loadtests.lora_bench --adapters 4 --rank 16 --concurrency 8 --num-requests 64
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from loadtests.serving_bench import Run, Summary, command_line, machine, summarize, table, warm_up
from loadtests.serving_client import Endpoint, Load, run_load
from loadtests.serving_scenarios import Session, ScenarioLengths, build_sessions
from loadtests.serving_targets import ServerConfig, started
from services.common.config import parse_bytes
from services.processor.tokenizer import load_tokenizer
from services.worker.loader import resolve_model

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapters(model_folder: Path, out: Path, count: int, rank: int) -> list[tuple[str, Path]]:
    """`count` random rank-`rank` PEFT adapters of `model_folder` under `out`: (name, folder) each."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapters = []
    for i in range(count):
        model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS), init_lora_weights=False)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)
            peft_model = get_peft_model(model, config)
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        folder = out / f"adapter{i}"
        peft_model.save_pretrained(folder)
        adapters.append((f"adapter{i}", folder))
    return adapters


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtests.lora_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("1GiB"))
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--max-duration", type=float, default=1800.0)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--log-dir", type=Path, default=None)
    return parser


async def bench(label: str, endpoint: Endpoint, sessions: Sequence[Session], args: argparse.Namespace) -> Summary:
    await warm_up(endpoint, args.warmup, args)
    run = Run(1, "short-chat", Load(concurrency=args.concurrency), list(sessions))
    result = await run_load(endpoint, run.sessions, run.load, args.max_tokens, args.timeout, args.max_duration)
    summary = summarize(label, run, result, args.max_tokens)
    print(f"lora_bench: {label}: {summary.ok}/{summary.requests} ok, {summary.output_rate:.1f} out tok/s",
          file=sys.stderr, flush=True)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="lora_bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    folder = resolve_model(args.model)
    adapters = make_adapters(folder, log_dir, args.adapters, args.rank)
    sessions = build_sessions("short-chat", args.num_requests, 1, load_tokenizer(folder), ScenarioLengths())
    lora_sessions = [dataclasses.replace(s, model=adapters[i % len(adapters)][0]) for i, s in enumerate(sessions)]
    base = ServerConfig(args.model, args.dtype, "cpu", args.kv_cache_memory, max(args.concurrency, 8), 2048, 600.0,
                        log_dir, args.threads)
    lora = dataclasses.replace(base, kvmesh_args=(
        "--enable-lora", "--max-loras", str(args.adapters), "--max-lora-rank", str(args.rank),
        "--lora-modules", *(f"{name}={path}" for name, path in adapters)))
    summaries = []
    for label, config, runs in (("base", base, sessions), ("adapters", lora, lora_sessions),
                                ("adapters", lora, lora_sessions), ("base", base, sessions)):
        with started("kvmesh", config) as endpoint:
            summaries.append(asyncio.run(bench(label, endpoint, runs, args)))
    print(f"\nLoRA benchmark: {args.adapters} adapters of rank {args.rank} on {args.model} ({args.dtype}), "
          f"{args.concurrency} streams, {args.num_requests} requests of {args.max_tokens} tokens, "
          f"EOS ignored, greedy; server threads {args.threads}; order base, adapters, adapters, base.\n")
    print(table(summaries, {}))
    complete = all(s.incomplete() is None for s in summaries)
    base_rate = (summaries[0].output_rate + summaries[3].output_rate) / 2
    lora_rate = (summaries[1].output_rate + summaries[2].output_rate) / 2
    base_tpot = (summaries[0].tpot[0] + summaries[3].tpot[0]) / 2
    lora_tpot = (summaries[1].tpot[0] + summaries[2].tpot[0]) / 2
    if complete:
        verdict = "met" if lora_rate >= 0.8 * base_rate else "NOT met"
        print(f"\n- adapters / base out tok/s: {lora_rate / base_rate:.2f}x (goal >= 0.80x: {verdict}); "
              f"TPOT p50 {lora_tpot:.1f} ms against {base_tpot:.1f} ms: {lora_tpot - base_tpot:+.1f} ms a step")
    else:
        print("\n- no ratio: " + "; ".join(s.incomplete() for s in summaries if s.incomplete()))
    print(f"\nMachine: {machine()}.\nCommand: {command_line(argv, 'loadtests.lora_bench')}")
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
