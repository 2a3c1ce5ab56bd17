"""How long `kvmesh serve` takes to come up, and the CPU its processes spend on it.

    .venv/bin/python -m loadtests.startup_bench [--model smollm2] [--runs 3] [--shipped] [--cold]

Each run starts `kvmesh serve` (float32, a 64 MiB KV cache, a 256-token context; with --shipped,
the flags of `make serve`: the KV cache a share of free memory), waits for the ready line it
prints once every service answers (read every half second), then stops it with SIGTERM. serve
reaps its children as it stops, so the CPU of the whole process tree is what this process's
children used. With --cold each run has an empty cache directory of its own (KVMESH_CACHE_DIR), as
a first start on a new machine: the model converted, the CPU kernels compiled.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time

from loadtests.serve_process import start_serve, stop_serve
from services.common.processes import free_ports

FLAGS = ("--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "256")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--shipped", action="store_true", help="no flags but the model's, as `make serve`")
    parser.add_argument("--cold", action="store_true", help="an empty cache directory for each run")
    args = parser.parse_args()
    flags = () if args.shipped else FLAGS
    for run in range(1, args.runs + 1):
        with tempfile.TemporaryDirectory(prefix="kvmesh-cold-") as cache:
            env = {"KVMESH_CACHE_DIR": cache} if args.cold else None
            cpu, start = children_cpu(), time.monotonic()
            proc, _, _ = start_serve(["--model", args.model, "--port", str(free_ports(1)[0]), *flags], env=env)
            ready = time.monotonic() - start
            stop_serve(proc)
        print(f"run {run}: ready after {ready:.1f} s, {children_cpu() - cpu:.1f} s of CPU up and down")


if __name__ == "__main__":
    main()
