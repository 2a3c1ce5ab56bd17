"""xgrammar against llguidance on this model's tokenizer (docs/features/structured_outputs.md): per schema the
grammar's compile time, the per-token mask time along a walk through the grammar, and whether the
walk's text (decoded by the tokenizer) parses and validates.

The walk needs no model: at each step it takes a random allowed token (seeded), preferring the
end-of-sequence token once the grammar allows it, for at most --max-steps tokens. Both backends
get the same seed, so a difference in validity is theirs, not the walk's.

    python -m loadtests.grammar_backends [--model smollm2] [--repeat 3] [--max-steps 80]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np

from loadtests.json_schemas import JSON_SCHEMAS
from services.common.model_files import resolve_tokenizer
from services.processor.tokenizer import load_tokenizer


def allowed_ids(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids whose bit is set in a packed int32 mask row (bit i of word w: token 32 w + i)."""
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: int) -> None:
        import llguidance

        self.llg = llguidance
        start = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.setup_s = time.perf_counter() - start
        self.vocab_size = vocab_size

    def compile(self, schema: dict[str, Any]) -> Any:
        # Compact JSON, as xgrammar's any_whitespace=False below (and services/engine/grammar.py).
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                              defaults={"whitespace_flexible": False})
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, bitmask: np.ndarray) -> None:
        from llguidance.numpy import fill_next_token_bitmask
        fill_next_token_bitmask(matcher, bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def done(self, matcher: Any) -> bool:
        return matcher.is_stopped()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        start = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.setup_s = time.perf_counter() - start
        self.vocab_size = vocab_size

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: np.ndarray) -> None:
        import torch
        matcher.fill_next_token_bitmask(torch.from_numpy(bitmask))

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher: Any) -> bool:
        return matcher.is_terminated()


def walk(backend: Any, compiled: Any, eos: int, seed: int, max_steps: int) -> tuple[list[int], list[float], bool]:
    """One seeded random walk: the tokens, each mask's fill time (s), whether the grammar ended."""
    rng = random.Random(seed)
    matcher = backend.matcher(compiled)
    bitmask = np.full((1, (backend.vocab_size + 31) // 32), -1, dtype=np.int32)
    tokens: list[int] = []
    fills: list[float] = []
    for _ in range(max_steps):
        start = time.perf_counter()
        backend.fill(matcher, bitmask)
        fills.append(time.perf_counter() - start)
        allowed = allowed_ids(bitmask[0], backend.vocab_size)
        assert len(allowed), "the grammar allows no token"
        token = eos if eos in allowed else int(allowed[rng.randrange(len(allowed))])
        assert backend.accept(matcher, token), f"{backend.name} refused the token its own mask allowed"
        if token != eos:
            tokens.append(token)
        if token == eos or backend.done(matcher):  # llguidance stops once nothing but EOS could follow
            return tokens, fills, True
    return tokens, fills, False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeat", type=int, default=3, help="compiles per schema (the median is reported)")
    parser.add_argument("--max-steps", type=int, default=80)
    parser.add_argument("--walks", type=int, default=3, help="seeded walks per schema")
    args = parser.parse_args()
    path = resolve_tokenizer(args.model)
    hf_tokenizer = load_tokenizer(path)
    eos = hf_tokenizer.eos_token_id
    vocab_size = len(hf_tokenizer)
    tokenizer_json = (Path(path) / "tokenizer.json").read_text()
    for backend in (Llguidance(tokenizer_json, vocab_size, eos), Xgrammar(hf_tokenizer, vocab_size, eos)):
        print(f"\n{backend.name}: tokenizer set-up {backend.setup_s * 1e3:.0f} ms (vocab {vocab_size})")
        print(f"{'schema':18} {'compile ms':>10} {'mask us p50':>12} {'mask us max':>12} {'ended':>6} {'valid':>6}")
        all_fills: list[float] = []
        for name, schema in JSON_SCHEMAS:
            times = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                compiled = backend.compile(schema)
                times.append(time.perf_counter() - start)
            fills: list[float] = []
            ended = valid = 0
            for seed in range(args.walks):
                tokens, step_fills, done = walk(backend, compiled, eos, seed, args.max_steps)
                fills += step_fills
                if done:
                    ended += 1
                    try:
                        jsonschema.validate(json.loads(hf_tokenizer.decode(tokens)), schema)
                        valid += 1
                    except (ValueError, jsonschema.ValidationError):
                        pass
            all_fills += fills
            print(f"{name:18} {statistics.median(times) * 1e3:10.2f} {statistics.median(fills) * 1e6:12.0f} "
                  f"{max(fills) * 1e6:12.0f} {ended:>4}/{args.walks} {valid:>4}/{ended}")
        print(f"all masks: p50 {statistics.median(all_fills) * 1e6:.0f} us, "
              f"p99 {np.percentile(all_fills, 99) * 1e6:.0f} us over {len(all_fills)}")


if __name__ == "__main__":
    main()
