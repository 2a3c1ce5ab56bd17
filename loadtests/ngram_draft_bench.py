"""What the engine's n-gram drafting costs a step: `--requests` decoding requests of `--tokens` random
tokens each, every one drafting (Speculator.draft) and then appending one token, as in a decode step.

    .venv/bin/python -m loadtests.ngram_draft_bench [--requests 32] [--tokens 4096] [--steps 200]

It prints the milliseconds per step spent reading the requests' contexts as numpy (Request.token_array)
and in the proposer's matching, summed over the requests.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from services.common.config import SpeculativeConfig
from services.common.sampling_params import SamplingParams
from services.engine.request import Request
from services.engine.speculator import Speculator

VOCAB = 49152


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32, help="decoding requests")
    parser.add_argument("--tokens", type=int, default=4096, help="each request's context at the start")
    parser.add_argument("--steps", type=int, default=200, help="steps timed (after as many to warm up)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4))
    max_tokens = 4 * args.steps
    requests = [Request(f"r{i}", rng.integers(0, VOCAB, args.tokens).tolist(), SamplingParams(max_tokens=max_tokens),
                        max_tokens, block_size=16) for i in range(args.requests)]
    for timed in (False, True):
        read = match = 0.0
        for _ in range(args.steps):
            for request in requests:
                start = time.perf_counter()
                tokens = request.token_array()
                middle = time.perf_counter()
                speculator.proposer.propose(tokens)
                read += middle - start
                match += time.perf_counter() - middle
                request.append_output_token_ids([int(rng.integers(0, VOCAB))])
        if timed:
            print(f"{args.requests} requests x {args.tokens}+ tokens, per step: context to numpy "
                  f"{read / args.steps * 1e3:.3f} ms, n-gram match {match / args.steps * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
