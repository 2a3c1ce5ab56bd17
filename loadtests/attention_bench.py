"""Decode attention on the CPU, per backend, and its share of a whole engine step.

  1. One layer's decode attention (the backend's `forward`: the step's K/V write, then attention)
     for a batch of B sequences with L-token contexts, with the default model's heads, on each CPU
     path: `torch` (SDPA over the gathered blocks), `cpu` (the native kernel reading the paged cache
     in place) and `triton` (the Triton kernels under the interpreter: a correctness tool, timed once
     to show what it costs, never a serving path on the CPU). Median of --repeats calls.
  2. The share of attention in an engine step: the `LLM` serves B requests of L-token prompts
     (random token ids, so no prefix-cache hits) for --output-len tokens; every call of the
     backend's `forward` is timed inside the step (the CPU runs it synchronously), and the decode
     steps report median step time, attention time (all layers) and their quotient.

    .venv/bin/python -m loadtests.attention_bench                                  # the published numbers
    .venv/bin/python -m loadtests.attention_bench --batch 8 --context 256 --output-len 4 --backends torch
"""

from __future__ import annotations

import os
import sys

# The Triton path runs under the interpreter here; Triton reads this when the kernels are imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import argparse  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

import torch  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from services import LLM, SamplingParams  # noqa: E402
from services.worker.attention import AttentionMetadata, get_attention_backend  # noqa: E402
from services.worker.loader import resolve_model  # noqa: E402

BLOCK_SIZE = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def decode_metadata(batch: int, context: int, gen: torch.Generator) -> AttentionMetadata:
    """One decode token per sequence at position context - 1, contexts in shuffled blocks 1..N."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    block_table = (torch.randperm(batch * blocks_per_seq, generator=gen) + 1).view(batch, blocks_per_seq).int()
    pos = context - 1
    slot_mapping = block_table[:, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
    return AttentionMetadata(
        num_tokens=batch, num_reqs=batch, query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), context, dtype=torch.int32), positions=torch.full((batch,), pos),
        slot_mapping=slot_mapping, block_table=block_table, block_size=BLOCK_SIZE, max_query_len=1,
        max_seq_len=context, query_lens_cpu=[1] * batch, seq_lens_cpu=[context] * batch,
    )


def time_layer(backend_name: str, layer: Any, batch: int, context: int, dtype: torch.dtype, repeats: int) -> float:
    """Median seconds of one layer's `forward` for a decode batch (after one warm-up call)."""
    gen = torch.Generator().manual_seed(0)
    meta = decode_metadata(batch, context, gen)
    num_blocks = batch * -(-context // BLOCK_SIZE) + 1
    kv_cache = torch.randn((2, num_blocks, BLOCK_SIZE, layer.num_kv_heads, layer.head_size), generator=gen).to(dtype)
    q = torch.randn((batch, layer.num_heads, layer.head_size), generator=gen).to(dtype)
    k, v = torch.randn((2, batch, layer.num_kv_heads, layer.head_size), generator=gen).to(dtype)
    backend = get_attention_backend(backend_name, torch.device("cpu"))
    plan = backend.plan(meta)
    backend.forward(layer, q, k, v, kv_cache, plan)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.forward(layer, q, k, v, kv_cache, plan)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class TimedBackend:
    """Wraps a backend; adds up the seconds spent in `forward` (the whole attention of a layer)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.seconds = 0.0

    def plan(self, meta: AttentionMetadata) -> Any:
        return self.inner.plan(meta)

    def forward(self, layer, q, k, v, kv_cache, plan) -> torch.Tensor:
        start = time.perf_counter()
        out = self.inner.forward(layer, q, k, v, kv_cache, plan)
        self.seconds += time.perf_counter() - start
        return out


class StepShare(NamedTuple):
    decode_steps: int
    step_ms: float  # median decode step
    attention_ms: float  # median attention time in a decode step, all layers
    share: float  # median of attention / step over the decode steps


def engine_share(args: argparse.Namespace, backend_name: str) -> StepShare:
    # A KV cache that holds every request at once (no preemption), with a block of slack each.
    config = AutoConfig.from_pretrained(args.model)
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    tokens = args.batch * (args.context + args.output_len + BLOCK_SIZE)
    itemsize = DTYPES[args.dtype].itemsize
    kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_size * tokens * itemsize
    llm = LLM(model=args.model, dtype=args.dtype, attention_backend=backend_name, max_num_seqs=args.batch,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=kv_bytes,
              max_model_len=args.context + args.output_len + 1, enable_prefix_caching=False)
    runner = llm.worker.runner
    timed = TimedBackend(runner.backend)
    runner.backend = timed
    execute = runner.execute_model
    steps: list[tuple[float, float]] = []  # (step seconds, attention seconds) of decode steps

    def timed_execute(out):
        timed.seconds = 0.0
        start = time.perf_counter()
        result = execute(out)
        if out.total_num_scheduled_tokens and out.total_num_scheduled_tokens == len(out.num_scheduled_tokens):
            steps.append((time.perf_counter() - start, timed.seconds))
        return result

    runner.execute_model = timed_execute
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size, (args.context,), generator=gen).tolist() for _ in range(args.batch)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == args.output_len for o in outputs)
    del llm
    return StepShare(len(steps), 1e3 * statistics.median(s for s, _ in steps),
                     1e3 * statistics.median(a for _, a in steps), statistics.median(a / s for s, a in steps))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a Hugging Face model folder")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--backends", default="torch,cpu", help="CPU paths timed in both parts")
    parser.add_argument("--triton-shapes", default="32x1024,4x128",
                        help="batch x context for the Triton interpreter, timed once each ('' to skip)")
    parser.add_argument("--output-len", type=int, default=16, help="tokens generated in the engine part")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.model = str(resolve_model(args.model))
    config = AutoConfig.from_pretrained(args.model)
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layer = SimpleNamespace(num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                            head_size=head_size, scale=head_size**-0.5, sliding_window=None, logits_soft_cap=None)
    dtype = DTYPES[args.dtype]
    backends = [b for b in args.backends.split(",") if b]
    print(f"command: {sys.executable} -m loadtests.attention_bench {shlex.join(sys.argv[1:])}".rstrip())
    print(f"model {config.architectures[0]}: {config.num_hidden_layers} layers, {layer.num_heads} query heads, "
          f"{layer.num_kv_heads} KV heads, head size {head_size}; {args.dtype}; "
          f"{torch.get_num_threads()} torch threads on {os.cpu_count()} CPUs")

    print(f"\none layer's decode attention, batch {args.batch} x context {args.context} (median of {args.repeats}):")
    for name in backends:
        seconds = time_layer(name, layer, args.batch, args.context, dtype, args.repeats)
        print(f"  {name:7s} {seconds * 1e3:9.2f} ms")
    for shape in filter(None, args.triton_shapes.split(",")):
        batch, context = map(int, shape.split("x"))
        seconds = time_layer("triton", layer, batch, context, dtype, repeats=1)
        print(f"  triton  {seconds * 1e3:9.0f} ms  (interpreter, batch {batch} x context {context}, one call)")

    if args.skip_engine:
        return
    print(f"\nengine decode steps, {args.batch} requests of {args.context} prompt tokens, "
          f"{args.output_len} new tokens each:")
    for name in backends:
        share = engine_share(args, name)
        print(f"  {name:7s} {share.decode_steps} decode steps: step {share.step_ms:.1f} ms, "
              f"attention {share.attention_ms:.1f} ms, share {100 * share.share:.0f} %")


if __name__ == "__main__":
    main()
