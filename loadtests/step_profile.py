"""Where an in-process decode step goes: `LLM.generate` of M ~50-token prompts (the
default model, greedy, EOS ignored) for 4 and for 68 output tokens; each row is the per-step
difference over the 64 extra steps of the time spent in that function (wall clock, timers wrapped
around the module functions, so nested rows overlap and the wrappers add ~1 us a call). With the
native decoder (services/worker/native_decoder.py) the layers' kernels are called from C and show up
only inside `model.forward`.

    .venv/bin/python -m loadtests.step_profile 1
    .venv/bin/python -m loadtests.step_profile 32
    .venv/bin/python -m loadtests.step_profile 32 auto     # with --dtype auto
"""

from __future__ import annotations

import collections
import functools
import sys
import time

import kvmesh_kernels.cpu_fused_ops as fused_ops
import kvmesh_kernels.cpu_quant_matmul as quant_matmul
import services.worker.layers.activation as activation
import services.worker.layers.rotary_embedding as rotary
import services.worker.models.llama as llama
from services import LLM, SamplingParams
from services.worker.attention import torch_backend

TOTALS: dict[str, float] = collections.defaultdict(float)


def timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[label] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
    llm = LLM(model="smollm2", dtype=dtype)
    for owner, name, label in (
        (quant_matmul, "matmul_packed", "matmul_packed"), (quant_matmul, "matmul", "matmul (LM head)"),
        (quant_matmul, "linear", "linear (all)"), (fused_ops, "add_rms_norm", "add_rms_norm"),
        (fused_ops, "kv_write", "kv_write"), (torch_backend, "paged_decode_attention", "attention"),
        (rotary, "split_and_rotate_qkv", "split_and_rotate"), (activation.SiluAndMul, "forward", "silu"),
    ):
        timed(owner, name, label)
    llama.split_and_rotate_qkv = rotary.split_and_rotate_qkv
    runner = llm.worker.runner
    for owner, name in ((runner.model, "forward"), (runner.model, "compute_logits"), (runner, "_sample"),
                        (runner, "execute_model"), (llm.engine, "step")):
        timed(owner, name, f"{type(owner).__name__}.{name}")
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8] * 6 for _ in range(rows)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    runs = {}
    for tokens in (4, 68):
        TOTALS.clear()
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
        runs[tokens] = (time.perf_counter() - start, dict(TOTALS))
    (short, short_parts), (long, long_parts) = runs[4], runs[68]
    print(f"M={rows} {dtype}: per decode step {(long - short) / 64 * 1e3:.2f} ms")
    per_step = {k: (v - short_parts.get(k, 0.0)) / 64 * 1e3 for k, v in long_parts.items()}
    for label, ms in sorted(per_step.items(), key=lambda item: -item[1]):
        print(f"  {label:32s} {ms:7.3f} ms")


if __name__ == "__main__":
    main()
