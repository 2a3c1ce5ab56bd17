"""Offline throughput of `LLM.chat` against transformers `generate` run one request at a time, and
against this machine's matmul roofline.

For each dtype:
  1. kvmesh: build `LLM`, warm up with a tiny generate, empty the prefix cache, then time one
     `llm.chat(conversations, SamplingParams(temperature=0, max_tokens=L, ignore_eos=True))` over the
     benchmark conversations (`loadtests.chat_prompts`); every output must have exactly L tokens.
  2. HF sequential: `AutoModelForCausalLM.generate(do_sample=False, max_new_tokens=L,
     min_new_tokens=L)` one request at a time on the first `--baseline-prompts` of the same prompt
     token ids (`loadtests.hf_baseline`); its tok/s is the rate over those N requests.
  3. Roofline: torch's matmul GFLOP/s at the model's shapes for a batch of the engine's decode batch
     size, min(num_prompts, max_num_seqs), divided by matmul FLOPs per token (`loadtests.roofline`).
Output tok/s = generated tokens / wall time (prefill included). The fraction of the roofline is the
matmul work the run did (prompt and output tokens, 2 x params FLOPs each; the LM head only where
a token is sampled) per second over the roofline's GFLOP/s, as MFU is counted; the table also
shows the stricter output tok/s over the roofline's tok/s, which counts prefill time but not its
work. Targets from the issue: >= 15x the sequential baseline and >= 50 % of the roofline, in the
better dtype.

Run from the repository root:

    .venv/bin/python -m loadtests.offline_throughput                          # the published numbers
    .venv/bin/python -m loadtests.offline_throughput --num-prompts 4 --output-len 8 --baseline-prompts 1
    .venv/bin/python -m loadtests.offline_throughput --dtype bfloat16 --baseline-prompts 0 --profile

`--baseline-prompts 0` skips the HF baseline; `--profile` re-runs the kvmesh part (on an emptied
prefix cache, after the timed run, so the timing stays clean) under `torch.profiler` and prints the
top 25 ops by self CPU time. The KV cache is sized to hold every request at once (no preemption)
unless `--kv-cache-gib` says otherwise. All three parts run at the same `torch.get_num_threads()`;
on a machine shared with other jobs, `--threads 1` avoids the stalls of an OpenMP team waiting for a
descheduled thread (which make small matmuls tens of times slower), but the published numbers are for a
quiet machine at torch's default thread count.
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
import transformers
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig

from loadtests.chat_prompts import Conversation, chat_conversations
from loadtests.hf_baseline import BaselineResult, chat_prompt_token_ids, run_baseline
from loadtests.roofline import DTYPES, attention_flops_per_token, flops_per_token, matmul_shapes, measure_roofline
from services import LLM, SamplingParams
from services.worker.loader import resolve_model

GIB = 1 << 30
BLOCK_SIZE = 16  # the LLM's default


class KvmeshResult(NamedTuple):
    dtype: str
    num_prompts: int
    prompt_tokens: int
    cached_prompt_tokens: int  # prefix-cache hits inside the run (the shared system prompt)
    generated_tokens: int
    seconds: float
    prompt_token_ids: list[list[int]]
    token_ids: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds


class Row(NamedTuple):
    kvmesh: KvmeshResult
    baseline: BaselineResult | None
    roofline: dict[str, Any]


def kv_cache_bytes(config: transformers.PretrainedConfig, dtype: str, num_tokens: int) -> int:
    """Bytes of K and V for `num_tokens` tokens over all layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    element_size = torch.empty((), dtype=DTYPES[dtype]).element_size()
    return 2 * config.num_hidden_layers * num_kv_heads * head_dim * element_size * num_tokens


def matmul_flops_of(config: transformers.PretrainedConfig, result: KvmeshResult) -> int:
    """The matmul FLOPs a run did. Each request runs L full passes (its last prompt token, then L - 1
    fed-back outputs) and, for its other uncached prompt tokens, passes without the LM head."""
    full = flops_per_token(config)
    head = next(s.flops_per_token for s in matmul_shapes(config) if s.name == "lm_head")
    prefill_only = result.prompt_tokens - result.cached_prompt_tokens - result.num_prompts
    return result.generated_tokens * full + prefill_only * (full - head)


def chat_params(output_len: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)


def time_chat(llm: LLM, conversations: list[Conversation], output_len: int, dtype: str) -> KvmeshResult:
    """Time one `llm.chat` over all conversations, from an empty prefix cache; check the lengths."""
    if not llm.engine.reset_prefix_cache():
        raise RuntimeError("could not empty the prefix cache: requests still hold blocks")
    start = time.perf_counter()
    outputs = llm.chat(conversations, chat_params(output_len))
    seconds = time.perf_counter() - start
    token_ids = [o.outputs[0].token_ids for o in outputs]
    wrong = [(i, len(t)) for i, t in enumerate(token_ids) if len(t) != output_len]
    if wrong:
        raise RuntimeError(f"outputs without exactly {output_len} tokens (index, length): {wrong[:8]}")
    prompt_token_ids = [o.prompt_token_ids for o in outputs]
    return KvmeshResult(dtype, len(outputs), sum(map(len, prompt_token_ids)),
                        sum(o.num_cached_tokens for o in outputs), sum(map(len, token_ids)), seconds,
                        prompt_token_ids, token_ids)


def profile_chat(llm: LLM, conversations: list[Conversation], output_len: int) -> str:
    """The top 25 ops by self CPU time of one `llm.chat` over all conversations, from an empty prefix cache."""
    if not llm.engine.reset_prefix_cache():
        raise RuntimeError("could not empty the prefix cache: requests still hold blocks")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.chat(conversations, chat_params(output_len))
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def agreement(kvmesh: list[list[int]], hf: list[list[int]], eos_token_ids: tuple[int, ...]) -> str:
    """How far the greedy outputs agree. HF's min_new_tokens forbids EOS while kvmesh's ignore_eos
    samples it and goes on, so they can only agree up to kvmesh's first EOS."""
    same, prefixes = 0, []
    for ours, theirs in zip(kvmesh, hf):
        end = next((i for i, t in enumerate(ours) if t in eos_token_ids), len(ours))
        common = next((i for i, (a, b) in enumerate(zip(ours[:end], theirs)) if a != b), end)
        same += common == end
        prefixes.append(common)
    return (f"{same}/{len(hf)} baseline outputs identical up to kvmesh's first EOS; "
            f"common prefix {sum(prefixes) / len(prefixes):.1f} tokens on average")


def command_line() -> str:
    python = sys.executable
    if python.startswith(os.getcwd() + os.sep):
        python = os.path.relpath(python)
    return f"{python} -m loadtests.offline_throughput {shlex.join(sys.argv[1:])}".rstrip()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return "?"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a Hugging Face model folder")
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--baseline-prompts", type=int, default=16,
                        help="how many prompts the sequential HF baseline runs (0: skip it)")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="KV-cache budget (default: enough to hold every request at once)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--roofline-repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true",
                        help="also run the kvmesh part under torch.profiler and print the top 25 ops")
    args = parser.parse_args()
    if not 0 <= args.baseline_prompts <= args.num_prompts:
        parser.error("--baseline-prompts must be between 0 and --num-prompts")
    return args


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    model_path = resolve_model(args.model, None)
    config = AutoConfig.from_pretrained(model_path)
    prompt_ids = chat_prompt_token_ids(model_path, args.num_prompts)
    print(f"command: {command_line()}")
    print(f"{cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
          f"(torch.get_num_threads() = {torch.get_num_threads()}), transformers {transformers.__version__}")
    rows = [run_dtype(args, model_path, config, prompt_ids, dtype) for dtype in args.dtype]
    print_summary(args, config, rows)


def run_dtype(args: argparse.Namespace, model_path: Path, config: transformers.PretrainedConfig,
              prompt_ids: list[list[int]], dtype: str) -> Row:
    """kvmesh, then the HF baseline, then the roofline, for one dtype."""
    print(f"\n== {dtype}", flush=True)
    # Room for every request's prompt and output at once, each rounded up to whole blocks.
    num_kv_tokens = sum(-(-(len(p) + args.output_len) // BLOCK_SIZE) * BLOCK_SIZE for p in prompt_ids)
    kv_bytes = (int(args.kv_cache_gib * GIB) if args.kv_cache_gib is not None
                else kv_cache_bytes(config, dtype, num_kv_tokens + 4 * BLOCK_SIZE))
    llm = LLM(model=args.model, dtype=dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=kv_bytes, block_size=BLOCK_SIZE)
    llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    conversations = chat_conversations(args.num_prompts)
    kvmesh = time_chat(llm, conversations, args.output_len, dtype)
    print(f"kvmesh: {kvmesh.num_prompts} prompts ({kvmesh.prompt_tokens} prompt tokens, "
          f"{kvmesh.cached_prompt_tokens} from the prefix cache) x {args.output_len} = "
          f"{kvmesh.generated_tokens} tokens in {kvmesh.seconds:.2f} s: {kvmesh.tokens_per_s:.1f} tok/s "
          f"(KV cache {kv_bytes / GIB:.2f} GiB)", flush=True)
    if kvmesh.prompt_token_ids != prompt_ids:
        raise RuntimeError("LLM.chat tokenized the prompts other than the HF baseline will see them")
    if args.profile:
        print(f"torch.profiler, top 25 ops by self CPU time ({dtype}, a second run on an emptied prefix cache):")
        print(profile_chat(llm, conversations, args.output_len), flush=True)
    eos_token_ids = llm.processor.info.eos_token_ids
    del llm
    gc.collect()

    baseline: BaselineResult | None = None
    if args.baseline_prompts:
        baseline = run_baseline(model_path, dtype, prompt_ids[: args.baseline_prompts], args.output_len)
        print(f"HF sequential: {baseline.num_prompts} prompts x {args.output_len} = "
              f"{baseline.generated_tokens} tokens in {baseline.seconds:.2f} s: {baseline.tokens_per_s:.1f} tok/s; "
              + agreement(kvmesh.token_ids, baseline.token_ids, eos_token_ids), flush=True)
        gc.collect()

    decode_batch = min(args.num_prompts, args.max_num_seqs)
    roofline = measure_roofline(config, dtype, decode_batch, repeats=args.roofline_repeats)
    print(f"roofline at batch {decode_batch}: {roofline['gflops']:.1f} GFLOP/s / "
          f"{roofline['flops_per_token'] / 1e6:.1f} MFLOP/token = {roofline['tokens_per_s']:.1f} tok/s; "
          f"kvmesh did {matmul_flops_of(config, kvmesh) / kvmesh.seconds / 1e9:.1f} GFLOP/s of matmul work, "
          f"prefill included", flush=True)
    return Row(kvmesh, baseline, roofline)


def print_summary(args: argparse.Namespace, config: transformers.PretrainedConfig, rows: list[Row]) -> None:
    decode_batch = min(args.num_prompts, args.max_num_seqs)
    first = rows[0].kvmesh
    mean_context = first.prompt_tokens / first.num_prompts + args.output_len / 2  # over a request's life
    print(f"\n## Offline throughput: {args.num_prompts} chat prompts x {args.output_len} output tokens (ignore_eos)\n")
    print(f"`{command_line()}`\n")
    print("| dtype | kvmesh tok/s | HF sequential tok/s | ratio | roofline GFLOP/s (tok/s) | matmul GFLOP/s done "
          "| % of roofline (FLOPs) | output tok/s ÷ roofline tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kvmesh, baseline, roofline in rows:
        hf = f"{baseline.tokens_per_s:.1f}" if baseline else "—"
        ratio = f"{kvmesh.tokens_per_s / baseline.tokens_per_s:.1f}x" if baseline else "—"
        done = matmul_flops_of(config, kvmesh) / kvmesh.seconds / 1e9
        print(f"| {kvmesh.dtype} | {kvmesh.tokens_per_s:.1f} | {hf} | {ratio} | {roofline['gflops']:.0f} "
              f"({roofline['tokens_per_s']:.1f}) | {done:.0f} | {100 * done / roofline['gflops']:.1f} % | "
              f"{100 * kvmesh.tokens_per_s / roofline['tokens_per_s']:.1f} % |")
    print()
    if args.baseline_prompts:
        print(f"- HF sequential tok/s is measured over the first {args.baseline_prompts} prompts, one at a time.")
    print(f"- Roofline: torch matmul GFLOP/s at the model's shapes for batch M = {decode_batch} "
          f"(min(num_prompts, max_num_seqs)), {torch.get_num_threads()} threads, divided by "
          f"{flops_per_token(config) / 1e6:.1f} MFLOP/token (2 x matmul params; attention adds "
          f"{attention_flops_per_token(config, round(mean_context)) / 1e6:.1f} MFLOP/token at the mean context of "
          f"{mean_context:.0f}, not counted). kvmesh tok/s includes prefill time.")
    ratios = [(k.tokens_per_s / b.tokens_per_s, k.dtype) for k, b, _ in rows if b]
    best_roof = max((matmul_flops_of(config, k) / k.seconds / 1e9 / r["gflops"], k.dtype) for k, _, r in rows)
    if ratios:
        best_ratio = max(ratios)
        print(f"- Target >= 15x the sequential baseline: best {best_ratio[0]:.1f}x ({best_ratio[1]}) — "
              f"{'met' if best_ratio[0] >= 15 else 'NOT met'}.")
    print(f"- Target >= 50 % of the roofline (matmul FLOPs done per second, prefill included, over the "
          f"roofline's GFLOP/s): best {100 * best_roof[0]:.1f} % ({best_roof[1]}) — "
          f"{'met' if best_roof[0] >= 0.5 else 'NOT met'}.")


if __name__ == "__main__":
    main()
