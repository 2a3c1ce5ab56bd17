"""A decode step of the whole default model at a batch of M requests, its weights as float32 (the
converted Hugging Face folder, `--quantization none`) against kept in the GGUF file's blocks (the
CPU default, `--quantization gguf`: Q4_1 layers, Q8_0 LM head) and against the folder's quantized at
load (`int8`: Q8_0 blocks, `f16`: float16), all through the same native kernel.

Per M: `LLM.generate` of M prompts (~100 tokens each, greedy, EOS ignored) for `--short` and for
`--short + --steps` output tokens, both after a warm-up; a decode step is the difference over
`--steps` (prefill, start-up and the first tokens cancel out; the engine's own per-step work, the
sampler and the LM head are in it, as in serving). Each cell is the best of `--repeats` runs,
configurations alternating, since a shared machine's load comes and goes.

Run from the repository root:

    .venv/bin/python -m loadtests.decode_step_bench
    .venv/bin/python -m loadtests.decode_step_bench --batch 1 8 32 --steps 32 --repeats 2
"""

from __future__ import annotations

import argparse
import gc
import time

from loadtests.chat_prompts import chat_conversations
from services import LLM, SamplingParams
from services.worker.loader import resolve_model

# label -> --quantization; the first is the baseline of the speed-ups.
CONFIGS = {"float32 folder": "none", "GGUF blocks (Q4_1)": "gguf", "int8 (Q8_0)": "int8", "f16": "f16"}


def timed_generate(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == tokens for o in outputs)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32], help="M values")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed")
    parser.add_argument("--short", type=int, default=4, help="output tokens of the baseline run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS.values()), choices=list(CONFIGS.values()))
    args = parser.parse_args()
    folder = str(resolve_model("smollm2"))
    engines = {label: LLM(model="smollm2" if mode == "gguf" else folder, quantization=mode,
                          kv_cache_memory=256 * 2**20, enable_prefix_caching=False)
               for label, mode in CONFIGS.items() if mode in args.configs}
    tokenizer = next(iter(engines.values())).get_tokenizer()
    texts = [" ".join(turn["content"] for turn in conv) for conv in chat_conversations()]
    print("| M | " + " | ".join(f"{label}: ms/step (tok/s, speed-up)" for label in engines) + " |")
    print("| --- | " + " | ".join("---" for _ in engines) + " |")
    for m in args.batch:
        prompts = [tokenizer.encode(texts[i % len(texts)])[:100] for i in range(m)]
        best = {label: float("inf") for label in engines}
        for label, llm in engines.items():
            timed_generate(llm, prompts, args.short)  # warm-up
        for _ in range(args.repeats):
            for label, llm in engines.items():
                step = (timed_generate(llm, prompts, args.short + args.steps)
                        - timed_generate(llm, prompts, args.short)) / args.steps
                best[label] = min(best[label], step)
        base = next(iter(best.values()))
        cells = " | ".join(f"{t * 1e3:.1f} ({m / t:.0f}, {base / t:.2f}x)" for t in best.values())
        print(f"| {m} | {cells} |", flush=True)
    engines.clear()
    gc.collect()


if __name__ == "__main__":
    main()
