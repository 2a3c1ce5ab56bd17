"""Resident memory of each `kvmesh serve` process once it has served a few requests.

Starts `python -m services.cli serve --print-addresses --kv-cache-memory 256MiB` (its JSON line gives
every service's pid), sends two completions and two chat completions (greedy, 32 tokens) to
127.0.0.1, then reads VmRSS and VmHWM from /proc/<pid>/status and whether libtorch is mapped, and
stops the stack.

    .venv/bin/python -m loadtests.service_memory [--port 8000]
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request

from loadtests.serve_process import start_serve, stop_serve

SERVICES = ("gateway", "processor", "engine", "worker")


def send_requests(api: str) -> None:
    for i in range(4):
        body: dict[str, object] = {"model": "smollm2", "max_tokens": 32, "temperature": 0}
        if i % 2:
            url, body["messages"] = f"{api}/chat/completions", [{"role": "user", "content": f"Tell me fact {i}"}]
        else:
            url, body["prompt"] = f"{api}/completions", f"The capital of France is {i}"
        request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            response.read()


def memory_of(pid: int) -> str:
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        status = dict(line.split(":", 1) for line in f)
    with open(f"/proc/{pid}/maps", encoding="utf-8") as f:
        torch = any("libtorch" in line for line in f)
    return f"VmRSS {status['VmRSS'].strip()}, VmHWM {status['VmHWM'].strip()}, libtorch mapped: {torch}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    serve, ready, _ = start_serve(["--kv-cache-memory", "256MiB", "--port", str(args.port)])
    try:
        send_requests(ready["api"])
        time.sleep(1.0)
        for name in SERVICES:
            print(f"{name}: {memory_of(ready['services'][name]['pid'])}")
    finally:
        stop_serve(serve)


if __name__ == "__main__":
    main()
