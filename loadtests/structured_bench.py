"""The per-token cost of structured outputs (docs/benchmarks/index.md), two ways:

1. End to end: the offline LLM generates --max-tokens tokens for each of 1 and 32 streams,
   unconstrained and under constraints that never end before --max-tokens (every mode generates the
   same number of tokens), greedy. Modes run interleaved, --repeat rounds, medians reported, so that a
   busy machine's noise falls on all modes alike.
2. The work itself, per step: the engine's mask fill for all rows (StructuredOutputManager.bitmask) and
   the worker's application to the logits (apply_grammar_bitmask), replayed along the outputs of (1).

    plain        no constraint (ignore_eos, so it runs to max_tokens)
    regex        [a-z ]{400}: a counted character class (llguidance's costliest lexer here)
    json_string  {"type": "string", "minLength": 400}: almost every token allowed

    python -m loadtests.structured_bench [--streams 1 32] [--max-tokens 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from services import LLM, SamplingParams
from services.common.scheduler_output import GrammarBitmask
from services.common.structured_outputs import StructuredOutputs
from services.engine.structured_output import RequestGrammar
from services.worker.grammar_bitmask import apply_grammar_bitmask

MODES = {
    "plain": None,
    "regex": StructuredOutputs("regex", "[a-z ]{400}"),
    "json_string": StructuredOutputs("json", json.dumps({"type": "string", "minLength": 400})),
}


def run(llm: LLM, streams: int, constraint: StructuredOutputs | None, max_tokens: int) -> tuple[float, list]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=constraint is None,
                            structured_outputs=constraint)
    prompts = [f"Write a long line of words, number {i}:" for i in range(streams)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def replay(llm: LLM, constraint: StructuredOutputs, outputs: list[list[int]]) -> tuple[float, float]:
    """Median ms per step of the mask fill and of its application, along the recorded outputs."""
    manager = llm.engine.structured_output
    eos = llm.processor.info.eos_token_ids
    grammars: list[RequestGrammar] = []
    for i in range(len(outputs)):
        manager.submit(f"replay-{i}", constraint, eos)
        manager._pending[f"replay-{i}"].future.result()
        grammars.append(manager.ready(f"replay-{i}"))
    ids = [f"r{i}" for i in range(len(outputs))]
    logits = torch.randn(len(outputs), manager.vocab_size)
    fills, applies = [], []
    for step in range(min(map(len, outputs))):
        start = time.perf_counter()
        bitmask = GrammarBitmask(ids, manager.bitmask(grammars))
        fills.append(time.perf_counter() - start)
        start = time.perf_counter()
        apply_grammar_bitmask(logits.clone(), ids, bitmask)
        applies.append(time.perf_counter() - start)
        for grammar, tokens in zip(grammars, outputs):
            assert grammar.accept(tokens[step])
    return statistics.median(fills) * 1e3, statistics.median(applies) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(model=args.model, max_model_len=512, max_num_seqs=max(args.streams))
    print(f"{'streams':>7} {'mode':12} {'tokens':>6} {'ms/step':>8} {'vs plain':>9} {'fill ms':>8} {'apply ms':>9}")
    for streams in args.streams:
        seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
        outputs: dict[str, list[list[int]]] = {}
        for mode, constraint in MODES.items():
            run(llm, streams, constraint, args.max_tokens)  # warm-up: the grammar is compiled and cached
        for _ in range(args.repeat):
            for mode, constraint in MODES.items():
                elapsed, outputs[mode] = run(llm, streams, constraint, args.max_tokens)
                seconds[mode].append(elapsed)
        base = None
        for mode, constraint in MODES.items():
            tokens = sum(map(len, outputs[mode]))
            per_step = statistics.median(seconds[mode]) / (tokens / streams) * 1e3
            base = per_step if base is None else base
            fill, apply = replay(llm, constraint, outputs[mode]) if constraint is not None else (0.0, 0.0)
            print(f"{streams:7d} {mode:12} {tokens:6d} {per_step:8.2f} {(per_step / base - 1) * 100:8.1f}% "
                  f"{fill:8.3f} {apply:9.3f}")


if __name__ == "__main__":
    main()
