"""KV-block transfer throughput between two processes: services/worker/kv_transfer.py's
send / receive over loopback, the same code the prefill and decode workers run (gloo on CPU; NCCL
on CUDA, which needs a device per process).

Two processes, each a KVTransferEndpoint on 127.0.0.1 over a KV cache shaped as SmolLM2-135M's (30
layers, 3 KV heads of 64, block 16, float32: 737,280 bytes per block); the sender sends --blocks
blocks (94: a 1,500-token prompt) --repeats times to the receiver, one transfer at a time. The first
transfer pays the pair's rendezvous and is reported apart. Times are the receiver's, from the call
to the blocks scattered into its cache.

    .venv/bin/python -m loadtests.kv_transfer_bench              # 94 blocks x 20
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

from loadtests.serving_bench import machine
from services.worker.kv_transfer import KVTransferEndpoint

LAYERS, KV_HEADS, HEAD_SIZE, BLOCK = 30, 3, 64, 16


def cache(num_blocks: int) -> list[torch.Tensor]:
    return [torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_SIZE) for _ in range(LAYERS)]


def sender(ids: mp.Queue, peer_ids: mp.Queue, blocks: int, repeats: int) -> None:
    endpoint = KVTransferEndpoint("127.0.0.1:0", torch.device("cpu"), timeout=30.0)
    ids.put(endpoint.endpoint_id)
    peer = peer_ids.get()
    kv = cache(2 * blocks)
    for tag in range(repeats):
        endpoint.send(peer, tag, kv, list(range(blocks)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=94)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    spawn = mp.get_context("spawn")  # a fresh interpreter: no forked torch state
    ids, peer_ids = spawn.Queue(), spawn.Queue()
    proc = spawn.Process(target=sender, args=(ids, peer_ids, args.blocks, args.repeats))
    proc.start()
    endpoint = KVTransferEndpoint("127.0.0.1:0", torch.device("cpu"), timeout=30.0)
    peer_ids.put(endpoint.endpoint_id)
    peer = ids.get()
    kv = cache(2 * args.blocks)
    seconds, num_bytes = [], 0
    for tag in range(args.repeats):
        start = time.perf_counter()
        num_bytes = endpoint.receive(peer, tag, kv, list(range(args.blocks, 2 * args.blocks)))
        seconds.append(time.perf_counter() - start)
    proc.join()
    steady = seconds[1:]
    median = statistics.median(steady)
    print(f"machine: {machine()}")
    print(f"{args.blocks} blocks = {num_bytes / 2**20:.1f} MiB per transfer, {args.repeats} transfers")
    print(f"first (with the rendezvous): {seconds[0] * 1e3:.1f} ms")
    print(f"steady: median {median * 1e3:.1f} ms ({num_bytes / median / 1e9:.2f} GB/s), "
          f"min {min(steady) * 1e3:.1f} ms ({num_bytes / min(steady) / 1e9:.2f} GB/s), max {max(steady) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
