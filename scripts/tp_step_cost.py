"""What tensor parallelism costs on this machine: the gloo collectives a TP=2 step makes,
and the step time of TP=1 against TP=2 (real `kvmesh worker` processes over gRPC, every step sent
to every rank at once by the tests' fan-out executor, tests/model/test_tp_hf_equivalence.py).

    PYTHONPATH=. python scripts/tp_step_cost.py

A TP=2 step makes 2 all-reduces per layer plus one for the embedding (61 for SmolLM2's 30 layers)
on [tokens, hidden], one gather of the sampled rows' logits on rank 0 and one broadcast of the
sampled ids. Prints microseconds per collective and milliseconds per step; about a minute.
"""

from __future__ import annotations

import statistics
import time
from contextlib import ExitStack

import torch
import torch.multiprocessing as mp

from services.common.config import ParallelConfig, SchedulerConfig
from services.common.engine_output import EngineCoreRequest
from services.common.sampling_params import SamplingParams
from services.worker.client import GrpcWorkerClient
from services.worker.loader import resolve_model
from services.worker.parallel_group import TensorParallelGroup, free_loopback_address
from tests.model.test_tp_hf_equivalence import FanOutExecutor, start_group

HIDDEN, VOCAB_PER_RANK = 576, 49152 // 2  # SmolLM2 at TP=2


def step_times(size: int, batch: int, prompt_len: int = 64, decode_steps: int = 40) -> tuple[float, float]:
    """(the prefill step, the median decode step) in seconds, `batch` requests at once."""
    with ExitStack() as exits:
        ranks = start_group(resolve_model("smollm2"), size, 256 * 2**20, 30.0)
        for rank in ranks:
            exits.callback(rank.kill)
        executor = FanOutExecutor([GrpcWorkerClient(r.address) for r in ranks])
        exits.callback(executor.close)
        engine = executor.engine(SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=64, max_num_waiting=None,
                                                 target_step_seconds=0))
        params = SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True)
        for i in range(batch):
            prompt = [(7 * i + j) % 1000 + 5 for j in range(prompt_len)]
            engine.add_request(EngineCoreRequest(str(i), prompt, params, (2,)))
        start = time.perf_counter()
        engine.step()
        prefill = time.perf_counter() - start
        decodes = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            decodes.append(time.perf_counter() - start)
        return prefill, statistics.median(decodes)


def _timed(fn, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def _collectives(rank: int, address: str, results: dict) -> None:
    torch.set_num_threads(1)
    tp = TensorParallelGroup.create(ParallelConfig(2, rank, address, 30.0), torch.device("cpu"))
    timings = {}
    for n in (1, 8, 64, 512):
        hidden, logits = torch.randn(n, HIDDEN), torch.randn(n, VOCAB_PER_RANK)
        _timed(lambda: (tp.all_reduce(hidden), tp.gather_to_driver(logits)), 5)  # warm up
        timings[n] = (_timed(lambda: tp.all_reduce(hidden), 50), _timed(lambda: tp.gather_to_driver(logits), 20),
                      _timed(lambda: tp.broadcast_tokens(list(range(n)) if rank == 0 else None, n), 50))
    results[rank] = timings
    tp.close()


def main() -> None:
    context = mp.get_context("spawn")
    with context.Manager() as manager:
        results = manager.dict()
        address = free_loopback_address()
        procs = [context.Process(target=_collectives, args=(r, address, results)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        for n, (reduce, gather, broadcast) in results[0].items():
            print(f"{n:4d} tokens: all_reduce [n, {HIDDEN}] {reduce * 1e6:7.0f} us, gather logits [n, {VOCAB_PER_RANK}] "
                  f"to rank 0 {gather * 1e6:7.0f} us, broadcast of n ids {broadcast * 1e6:5.0f} us")
    for batch in (1, 8):
        for size in (1, 2):
            prefill, decode = step_times(size, batch)
            print(f"TP={size}, batch {batch}: prefill step ({batch} x 64 tokens) {prefill * 1e3:.1f} ms, "
                  f"decode step (median) {decode * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
