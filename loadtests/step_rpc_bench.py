"""Engine<->worker step latency: round trips on the worker's step channel over loopback, model
compute excluded.

A worker server runs in a subprocess with a stand-in core whose execute_model returns a ready
answer at once, behind the real stack (WorkerServicer -> InProcessWorkerClient, on its step thread).
The client is the engine's GrpcWorkerClient, called with blocking calls from a plain thread as the
engine-loop thread calls it, so each round trip counts everything the engine pays per step besides
the model: SchedulerOutput -> proto -> bytes, the step channel's socket (services/worker/step_channel.py),
bytes -> proto -> SchedulerOutput, and the same for ModelRunnerOutput on the way back.
The first row, an empty gRPC health Check on the same server, is what a gRPC call alone costs on the
machine (the steps went over gRPC before the step channel); the "codec only" rows are the
conversions and (de)serialization of both ends, in one process.

    .venv/bin/python -m loadtests.step_rpc_bench                 # 2000 round trips per case
    .venv/bin/python -m loadtests.step_rpc_bench --iters 5000 --decode-reqs 64
    .venv/bin/python -m loadtests.step_rpc_bench --ranks 2        # a tensor-parallel group's fan-out

With --ranks N (N > 1) there are N such servers, and the client is the engine's GroupWorkerClient
over N GrpcWorkerClients (services/engine/executor.py): each step goes to every rank at once and
waits for all; the rows "1 rank (plain client)" and "group of N" then differ only by the fan-out.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.clients import WorkerInfo
from services.common.model_runner_output import ModelRunnerOutput
from services.common.rpc import convert
from services.common.rpc.kvmesh.v1 import worker_pb2
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from services.common.config import ServingConfig
from services.engine.executor import GroupWorkerClient
from services.worker.client import GrpcWorkerClient, InProcessWorkerClient
from services.worker.server import serve


class InstantCore:
    """Stands in for services.worker.worker.Worker: answers each step without computing."""

    info = WorkerInfo(model_id="instant", model_path="/nowhere", vocab_size=49152, max_model_len=8192, block_size=16)

    def determine_num_blocks(self) -> int:
        return 4096

    def initialize_cache(self, num_blocks: int, max_num_reqs: int) -> None:
        pass

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        req_ids = list(out.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids, [1234] * len(req_ids))


def empty_step() -> SchedulerOutput:
    return SchedulerOutput([], [], {}, 0)


def decode_step(num_reqs: int, step: int) -> SchedulerOutput:
    # Every 16th step each request crosses a block boundary (block_size 16) and gains a block;
    # spread them out as the real engine would: request i gains one on steps where (step + i) % 16 == 0.
    cached = [CachedRequestData(f"req-{i}", [1000 + step + i] if (step + i) % 16 == 0 else [], 500 + step)
              for i in range(num_reqs)]
    return SchedulerOutput([], cached, {c.req_id: 1 for c in cached}, num_reqs)


def prefill_step(num_reqs: int, prompt_len: int) -> SchedulerOutput:
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=256)
    new = [NewRequestData(f"new-{i}", list(range(prompt_len)), [], params, frozenset({2}),
                          list(range(i * prompt_len // 16, (i + 1) * prompt_len // 16)), 0)
           for i in range(num_reqs)]
    return SchedulerOutput(new, [], {r.req_id: prompt_len for r in new}, num_reqs * prompt_len)


def time_round_trips(call, make_arg, iters: int, warmup: int) -> list[float]:
    samples = []
    for i in range(warmup + iters):
        arg = make_arg(i)
        start = time.perf_counter()
        call(arg)
        if i >= warmup:
            samples.append(time.perf_counter() - start)
    return samples


def codec_round_trip(step: SchedulerOutput) -> None:
    """What both ends spend on (de)serializing one step and its answer, without the transport."""
    wire = convert.scheduler_output_to_proto(step).SerializeToString()
    back = convert.scheduler_output_from_proto(worker_pb2.SchedulerOutput.FromString(wire))
    answer = convert.model_runner_output_to_proto(InstantCore().execute_model(back)).SerializeToString()
    convert.model_runner_output_from_proto(worker_pb2.ModelRunnerOutput.FromString(answer))


def percentiles(samples: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(samples, n=100, method="inclusive")
    return q[49] * 1e6, q[89] * 1e6, q[98] * 1e6


def bench(addresses: list[str], args: argparse.Namespace) -> None:
    """Runs on a plain thread with blocking calls, as the engine's engine-loop thread does."""
    ranks = [GrpcWorkerClient(address, timeout=30) for address in addresses]
    for rank in ranks:
        rank.get_info()  # waits for the server (the stand-ins do not claim ranks: no group check)
    client = ranks[0] if len(ranks) == 1 else GroupWorkerClient(ranks)
    client.initialize_cache(args.decode_reqs)
    # What a gRPC call alone costs on this machine: the standard health Check, an empty unary call.
    channel = grpc.insecure_channel(addresses[0])
    health = health_pb2_grpc.HealthStub(channel)
    cases = [
        ("a gRPC call: grpc.health.v1 Check", lambda i: health_pb2.HealthCheckRequest()),
        ("empty step", lambda i: empty_step()),
        (f"decode step, {args.decode_reqs} requests", lambda i: decode_step(args.decode_reqs, i)),
        (f"new requests, {args.prefill_reqs} x {args.prompt_len} tokens",
         lambda i: prefill_step(args.prefill_reqs, args.prompt_len)),
    ]
    who = "1 rank (plain client)" if len(ranks) == 1 else f"group of {len(ranks)}"
    print(f"{'case (' + who + ')':<44} {'p50 us':>8} {'p90 us':>8} {'p99 us':>8}   ({args.iters} round trips each)")
    for name, make_arg in cases:
        call = health.Check if name.startswith("a gRPC call") else client.execute_model
        p50, p90, p99 = percentiles(time_round_trips(call, make_arg, args.iters, args.warmup))
        print(f"{name:<44} {p50:8.0f} {p90:8.0f} {p99:8.0f}")
    for name, make_arg in cases[1:]:
        p50, p90, p99 = percentiles(time_round_trips(codec_round_trip, make_arg, args.iters, args.warmup))
        print(f"{'codec only: ' + name:<44} {p50:8.0f} {p90:8.0f} {p99:8.0f}")
    client.close()
    channel.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--decode-reqs", type=int, default=32)
    parser.add_argument("--prefill-reqs", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--port", type=int, default=50099, help="the first server's; rank r listens on --port + r")
    parser.add_argument("--ranks", type=int, default=1, help="servers the step fans out to (a tensor-parallel group)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the subprocess side
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(serve(InProcessWorkerClient(InstantCore()), ServingConfig(port=args.port, grace=0)))
        return 0
    ports = [args.port + r for r in range(args.ranks)]
    servers = [subprocess.Popen([sys.executable, "-m", "loadtests.step_rpc_bench", "--serve", "--port", str(port)],
                                start_new_session=True) for port in ports]
    try:
        bench([f"127.0.0.1:{port}" for port in ports], args)
    finally:
        for server in servers:
            os.killpg(server.pid, signal.SIGTERM)
        for server in servers:
            server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
