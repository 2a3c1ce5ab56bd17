"""Speculative decoding (n-gram) against none, in-process, in the order A B B A (off, on, on, off).

Two loads, each greedy:
  copy     one stream asked to copy a ~300-token passage; time per output token =
           (time of N tokens - time of 1 token) / (N - 1), the best of `--repeats`
  chat     `--chat-streams` short chats at once (`loadtests.chat_prompts`), EOS ignored, output tok/s
Each run builds its own `LLM` (defaults: `--dtype auto`), warms it up and empties the prefix cache
between timings, so no run hits another's prompt. Greedy outputs must agree between the runs.

With --chat-pairs N the chat load then runs N more times each way on two `LLM`s held side by side,
off and on back to back (the pair's order alternating), and each pair gives a ratio: a shared VM's
speed drifts by more than the few percent speculation may cost, but not within a pair's seconds.

    .venv/bin/python -m loadtests.spec_decode_bench
    .venv/bin/python -m loadtests.spec_decode_bench --threads 1 --chat-streams 32 --max-tokens 128
    .venv/bin/python -m loadtests.spec_decode_bench --chat-pairs 12 --max-tokens 64
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from loadtests.chat_prompts import chat_conversations
from services import LLM, SamplingParams

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He lit the great lamp, wound the "
    "clockwork that turned the lens, and wrote the weather in a leather book that had belonged to his "
    "grandfather. On clear nights he could see the lights of three villages along the coast, and on foggy "
    "nights he sounded the horn every thirty seconds until morning. Ships passing the headland signalled "
    "their thanks with two short blasts. In winter the storms came from the north-west, and the waves broke "
    "over the rocks so high that spray reached the gallery rail. He kept a kettle on the stove, a cat named "
    "Admiral by the window, and a list of every ship he had seen, with its flag, its heading and the hour."
)
COPY_MESSAGES = [{"role": "user", "content": f"Copy this text exactly, word for word:\n\n{PASSAGE}"}]


def copy_seconds_per_token(llm: LLM, max_tokens: int, repeats: int) -> tuple[float, list[int]]:
    def timed(n: int) -> tuple[float, list[int]]:
        llm.engine.kv_cache_manager.reset_prefix_cache()
        start = time.perf_counter()
        [out] = llm.chat(COPY_MESSAGES, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start, out.outputs[0].token_ids

    best = float("inf")
    for _ in range(repeats):
        first, _ = timed(1)
        full, tokens = timed(max_tokens)
        best = min(best, (full - first) / (max_tokens - 1))
    return best, tokens


def chat_tokens_per_second(llm: LLM, streams: int, max_tokens: int) -> tuple[float, list[list[int]]]:
    llm.engine.kv_cache_manager.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.chat(chat_conversations(streams), params)
    seconds = time.perf_counter() - start
    return streams * max_tokens / seconds, [o.outputs[0].token_ids for o in outputs]


def make_llm(args: argparse.Namespace, spec: dict, name: str) -> LLM:
    """The stack of run `name`: "on" speculates with `spec`, "off" does not."""
    return LLM(model=args.model, max_num_seqs=max(args.chat_streams, 8),
               speculative_config=spec if name == "on" else None)


def chat_pairs(args: argparse.Namespace, spec: dict, pairs: int) -> tuple[list[float], list[float]]:
    """on ÷ off chat throughput of `pairs` back-to-back pairs of runs, each pair's order alternating, by
    wall clock and by the process's CPU time (all threads; a VM's stolen time is not in it)."""
    llms = {name: make_llm(args, spec, name) for name in ("off", "on")}
    reference = None
    for llm in llms.values():
        _, tokens = chat_tokens_per_second(llm, args.chat_streams, args.max_tokens)  # warm-up
        if reference is not None and tokens != reference:
            print("warning: the chat outputs differ with and without speculation")
        reference = tokens
    ratios, cpu_ratios = [], []
    for i in range(pairs):
        rates, cpu = {}, {}
        for name in ("off", "on") if i % 2 == 0 else ("on", "off"):
            start = time.process_time()
            rates[name] = chat_tokens_per_second(llms[name], args.chat_streams, args.max_tokens)[0]
            cpu[name] = time.process_time() - start
        ratios.append(rates["on"] / rates["off"])
        cpu_ratios.append(cpu["off"] / cpu["on"])
        print(f"pair {i + 1}: off {rates['off']:.1f}, on {rates['on']:.1f} tok/s, on ÷ off {ratios[-1]:.3f}; "
              f"CPU seconds off {cpu['off']:.2f}, on {cpu['on']:.2f}", flush=True)
    for llm in llms.values():
        llm.close()
    return ratios, cpu_ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                                                        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}')
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--chat-streams", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--chat-pairs", type=int, default=0, help="then this many back-to-back chat pairs")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = json.loads(args.speculative_config)
    results: list[tuple[str, float, float]] = []
    reference: dict[str, object] = {}
    for name in ("off", "on", "on", "off"):
        llm = make_llm(args, spec, name)
        llm.generate("warm up", SamplingParams(max_tokens=4))
        copy_tpot, copy_tokens = copy_seconds_per_token(llm, args.max_tokens, args.repeats)
        chat_rate, chat_tokens = chat_tokens_per_second(llm, args.chat_streams, args.max_tokens)
        for key, value in (("copy", copy_tokens), ("chat", chat_tokens)):
            if reference.setdefault(key, value) != value:
                print(f"warning: the {key} outputs differ from the first run's ({name})")
        accepted = ""
        if llm.engine.scheduler.speculator is not None:
            stats = llm.engine.scheduler.speculator.stats
            accepted = f"  accepted {stats.num_accepted_tokens}/{stats.num_draft_tokens} drafted tokens"
        print(f"speculation {name:3}: copy {copy_tpot * 1000:6.2f} ms/token   chat x{args.chat_streams} "
              f"{chat_rate:7.1f} tok/s{accepted}", flush=True)
        results.append((name, copy_tpot, chat_rate))
        llm.close()
        del llm
        gc.collect()
    off = [r for r in results if r[0] == "off"]
    on = [r for r in results if r[0] == "on"]
    print("\n| load | off (A, A) | on (B, B) | on ÷ off |\n| --- | ---: | ---: | ---: |")
    print(f"| copy, 1 stream, ms/token | {off[0][1] * 1e3:.2f} / {off[1][1] * 1e3:.2f} | "
          f"{on[0][1] * 1e3:.2f} / {on[1][1] * 1e3:.2f} | "
          f"{sum(r[1] for r in off) / sum(r[1] for r in on):.2f}x faster |")
    print(f"| chat, {args.chat_streams} streams, tok/s | {off[0][2]:.1f} / {off[1][2]:.1f} | "
          f"{on[0][2]:.1f} / {on[1][2]:.1f} | {sum(r[2] for r in on) / sum(r[2] for r in off):.3f} |")
    if args.chat_pairs:
        for what, ratios in zip(("wall clock", "CPU time"), chat_pairs(args, spec, args.chat_pairs)):
            ratios.sort()
            print(f"chat x{args.chat_streams}, {len(ratios)} back-to-back pairs, on ÷ off by {what}: median "
                  f"{statistics.median(ratios):.3f}, mean {statistics.mean(ratios):.3f}, "
                  f"range {ratios[0]:.3f}-{ratios[-1]:.3f}")


if __name__ == "__main__":
    main()
