"""The matmul roofline of a Llama-family model on this machine: FLOPs per generated token, torch's
GFLOP/s at the model's own matmul shapes, and their quotient, the most tokens/s the matmuls allow.

FLOPs per token are 2 x (the parameters of every matmul a token passes through): per layer the fused
q|k|v, o, the fused gate|up and down projections, then the LM head once. For SmolLM2-135M that is
2 x 134.5 M = 269 MFLOP/token. Attention's score and value products (4 x layers x heads x head_dim x
context FLOPs) depend on the context length and are reported apart; they are not in the roofline.

The measurement runs `F.linear(x [M, in], W [out, in])` (what `nn.Linear` and our model run) for
every weight of the model, each layer with its own weight tensor, so the weights stream from memory
as they do in a forward pass instead of sitting in cache. One "pass" (every layer's four matmuls,
then the LM head) is timed as the sum of its shapes' median times; the roofline is then
tokens/s = M / seconds_per_pass = GFLOP/s / FLOPs per token.

    .venv/bin/python -m loadtests.roofline                               # float32 and bfloat16, M in 1 32 128 256
    .venv/bin/python -m loadtests.roofline --dtype bfloat16 --batch 128 --repeats 9
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
import transformers
from transformers import AutoConfig

from services.worker.loader import resolve_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class MatmulShape(NamedTuple):
    name: str
    in_features: int
    out_features: int
    count: int  # how many such weights one token passes through (num_layers, or 1 for the LM head)

    @property
    def flops_per_token(self) -> int:
        return 2 * self.in_features * self.out_features * self.count


def matmul_shapes(config: transformers.PretrainedConfig) -> list[MatmulShape]:
    """The weight matmuls one token passes through, with fused q|k|v and gate|up as our model runs them."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    q_size, kv_size = config.num_attention_heads * head_dim, num_kv_heads * head_dim
    return [
        MatmulShape("qkv", hidden, q_size + 2 * kv_size, layers),
        MatmulShape("o", q_size, hidden, layers),
        MatmulShape("gate_up", hidden, 2 * config.intermediate_size, layers),
        MatmulShape("down", config.intermediate_size, hidden, layers),
        MatmulShape("lm_head", hidden, config.vocab_size, 1),
    ]


def flops_per_token(config: transformers.PretrainedConfig) -> int:
    """Matmul FLOPs per generated token, attention excluded: 2 x matmul parameters."""
    return sum(s.flops_per_token for s in matmul_shapes(config))


def attention_flops_per_token(config: transformers.PretrainedConfig, context_len: int) -> int:
    """FLOPs of Q.K^T and P.V for one new token attending to `context_len` tokens, over all layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 4 * config.num_hidden_layers * config.num_attention_heads * head_dim * context_len


def _median_seconds(fn, min_run_s: float, repeats: int) -> float:
    """Median seconds per call of `fn`: warm up, size a run to last `min_run_s`, time `repeats` runs."""
    for _ in range(2):
        fn()
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    calls = max(1, math.ceil(min_run_s / max(once, 1e-9)))
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls)
    return statistics.median(runs)


@torch.inference_mode()
def _time_shape(shape: MatmulShape, dtype: torch.dtype, batch: int, min_run_s: float, repeats: int) -> float:
    """Median seconds for `batch` tokens to pass through all `shape.count` weights of this shape."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape.out_features, shape.in_features, generator=generator).to(dtype)
               for _ in range(shape.count)]  # [out, in] each, distinct tensors as in the model
    x = torch.randn(batch, shape.in_features, generator=generator).to(dtype)  # [M, in]

    def run() -> None:
        for w in weights:
            F.linear(x, w)

    return _median_seconds(run, min_run_s, repeats)


def measure_roofline(config: transformers.PretrainedConfig, dtype: str | torch.dtype, batch: int,
                     min_run_s: float = 0.05, repeats: int = 5) -> dict[str, Any]:
    """Torch's matmul throughput at the model's shapes for a batch of `batch` tokens, and the tokens/s
    it allows. Keys: dtype, batch, threads, flops_per_token, seconds_per_pass, gflops, tokens_per_s,
    shape_gflops ({shape name: GFLOP/s})."""
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    shapes = matmul_shapes(config)
    seconds = {s.name: _time_shape(s, torch_dtype, batch, min_run_s, repeats) for s in shapes}
    per_pass = sum(seconds.values())
    fpt = flops_per_token(config)
    return {
        "dtype": str(torch_dtype).removeprefix("torch."),
        "batch": batch,
        "threads": torch.get_num_threads(),
        "flops_per_token": fpt,
        "seconds_per_pass": per_pass,
        "gflops": batch * fpt / per_pass / 1e9,
        "tokens_per_s": batch / per_pass,
        "shape_gflops": {s.name: batch * s.flops_per_token / seconds[s.name] / 1e9 for s in shapes},
    }


def markdown_table(results: list[dict[str, Any]]) -> str:
    names = list(results[0]["shape_gflops"])
    lines = [
        "| dtype | batch M | " + " | ".join(f"{n} GFLOP/s" for n in names) + " | pass GFLOP/s | roofline tok/s |",
        "|---|---:|" + "---:|" * len(names) + "---:|---:|",
    ]
    for r in results:
        shape_cols = " | ".join(f"{r['shape_gflops'][n]:.1f}" for n in names)
        lines.append(f"| {r['dtype']} | {r['batch']} | {shape_cols} | {r['gflops']:.1f} | {r['tokens_per_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a Hugging Face model folder")
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 32, 128, 256])
    parser.add_argument("--context-len", type=int, default=256,
                        help="context length for the (separately reported) attention FLOPs")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per shape; the median is kept")
    parser.add_argument("--min-run-s", type=float, default=0.05, help="each timed run lasts at least this long")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    config = AutoConfig.from_pretrained(resolve_model(args.model, None))
    print(f"model {args.model}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"intermediate {config.intermediate_size}, vocab {config.vocab_size}")
    for s in matmul_shapes(config):
        print(f"  {s.name:8s} [M, {s.in_features}] x [{s.in_features}, {s.out_features}] x {s.count}: "
              f"{s.flops_per_token / 1e6:.1f} MFLOP/token")
    print(f"matmul FLOPs per token: {flops_per_token(config) / 1e6:.1f} MFLOP "
          f"(+ attention {attention_flops_per_token(config, args.context_len) / 1e6:.1f} MFLOP "
          f"at context {args.context_len}, not in the roofline)")
    print(f"torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()}, "
          f"median of {args.repeats} runs of >= {args.min_run_s} s each, after warm-up\n")
    results = [measure_roofline(config, dtype, batch, args.min_run_s, args.repeats)
               for dtype in args.dtype for batch in args.batch]
    print(markdown_table(results))


if __name__ == "__main__":
    main()
