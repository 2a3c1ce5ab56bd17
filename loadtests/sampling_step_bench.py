"""What long token-id lists cost the worker: a batch of `--rows` requests that each allow
`--ids` token ids (duplicates included, as a client may send them), timed where the cost falls.

    .venv/bin/python -m loadtests.sampling_step_bench [--rows 16] [--ids 262144] [--vocab 49152]

It prints the time to build the rows' SamplingParams (each id list sorted and deduplicated), their
RequestSamplingTensors (once per request, when it joins the worker's batch), and then, per step, the
SamplingMetadata build and the sampler (best of --steps).
"""

from __future__ import annotations

import argparse
import time

import torch

from services.common.sampling_params import SamplingParams
from services.worker.sampler import Sampler
from services.worker.sampling_metadata import RequestSamplingTensors, SamplingMetadata

CPU = torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16, help="requests in the batch (a request's n)")
    parser.add_argument("--ids", type=int, default=2**18, help="entries of each allowed_token_ids, duplicates included")
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary size (smollm2's by default)")
    parser.add_argument("--steps", type=int, default=5, help="steps timed; the best is printed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ids = [i % args.vocab for i in range(args.ids)]
    start = time.perf_counter()
    params = [SamplingParams(temperature=0.0, allowed_token_ids=ids) for _ in range(args.rows)]
    made = time.perf_counter()
    stops = [frozenset({2})] * args.rows
    kept = [RequestSamplingTensors.of(p, s, args.vocab, CPU) for p, s in zip(params, stops)]
    joined = time.perf_counter()
    print(f"{args.rows} rows x {args.ids} allowed ids ({len(params[0].allowed_token_ids)} distinct), "
          f"vocabulary {args.vocab}")
    print(f"once per request: SamplingParams {(made - start) * 1e3:.1f} ms, "
          f"RequestSamplingTensors {(joined - made) * 1e3:.1f} ms (all rows)")
    logits = torch.randn(args.rows, args.vocab)
    builds, samples = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        meta = SamplingMetadata.build(params, [[]] * args.rows, [[1]] * args.rows, stops, args.vocab, CPU,
                                      request_tensors=kept)
        t1 = time.perf_counter()
        Sampler()(logits, meta)
        builds.append(t1 - t0)
        samples.append(time.perf_counter() - t1)
    print(f"per step: metadata {min(builds) * 1e3:.2f} ms, sampler {min(samples) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
