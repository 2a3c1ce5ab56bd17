"""Soak: `kvmesh serve` under a mixed load for a while, counting every answer that is not what it
should be and following each process's resident memory.

    .venv/bin/python -m loadtests.soak --duration 600 [--clients 6] [--port 8321]

It starts `python -m services.cli serve --print-addresses --kv-cache-memory 256MiB --no-access-log` on
--port (and stops it at the end), with an API key in KVMESH_API_KEY that every client sends.
`--clients` loops run until the duration is over, each picking (seeded) one of:

    chat          streamed chat, 8..48 tokens: 200, an SSE stream ending in [DONE] with a finish_reason
    completion    a short or a ~1,000-token prompt, not streamed: 200 and `max_tokens` tokens
    disconnect    a streamed chat dropped after its first chunks (the server must free it)
    tokenize      /tokenize of a chat: 200
    bad           one of BAD_REQUESTS: exactly the 4xx it names
    stall         a streamed chat with 20 top logprobs whose client reads nothing (a 4 KB receive window):
                  the gateway pauses it and cuts the connection --send-timeout (SEND_TIMEOUT) later,
                  before [DONE]
    crowd         one made-up client address opens one connection more than --max-connections-per-client:
                  the last is a 429 naming that flag
    intruder      one of INTRUSIONS on an internal gRPC port, with the gateway's own token (read from the
                  file serve gave it) or a made-up one: exactly the refusal it names

An answer with another status, a stream without [DONE], or an exception is *unexpected*. Every 15 s
it reads VmRSS of each service's process; memory is "flat" when the last sample is within
--rss-slack MB of the one taken after --warmup seconds. At the end it waits for the engine to be
idle and reads its running / waiting requests and KV-cache usage from /metrics (nothing may be left
behind). The summary is printed as Markdown (the table in docs/benchmarks/log.md) and, with --json, saved.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx2 as httpx

from loadtests.serve_process import start_serve, stop_serve
from services.common.config import SecurityConfig
from services.common.rpc.security import GATEWAY, PROCESSOR, RpcSecurity

SERVICES = ("gateway", "processor", "engine", "worker")
MODEL = "smollm2"
API_KEY = "soak-key"  # may not set priority: no --priority-api-key-file
PER_CLIENT = 32  # --max-connections-per-client: above what the client loops hold, all from 127.0.0.1
SEND_TIMEOUT = 5.0  # --send-timeout: seconds a client may leave its socket full
STALL_DEADLINE = 150.0  # seconds a stalled stream may take to be cut: its socket fills, then SEND_TIMEOUT
ROOT_PATHS = ("/tokenize", "/detokenize")  # vLLM's routes beside /v1
LONG_PROMPT = " ".join(f"Paragraph {i}: the river carried boats of grain and salt past the old mill." for i in range(60))


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"leaf": 1}
    for _ in range(depth):
        value = {"x": value}
    return value


# (name, path, raw JSON body or a dict, the status it must get)
BAD_REQUESTS: list[tuple[str, str, Any, int]] = [
    ("nan temperature", "/chat/completions",
     '{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400),
    ("deep chat_template_kwargs", "/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": _nested(60)}, 400),
    ("prompt over the context", "/completions", {"model": MODEL, "prompt": "x" * 2_000_000, "max_tokens": 4}, 400),
    ("unknown model", "/completions", {"model": "nope", "prompt": "hi"}, 404),
    ("too many choices", "/completions", {"model": MODEL, "prompt": "hi", "n": 1000}, 400),
    ("broken JSON", "/completions", '{"model": "smollm2", "prompt": ', 400),
    ("logit_bias out of vocabulary", "/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"999999": 1}}, 400),
    ("allowed_token_ids of 2^18 duplicates, n=16", "/completions",
     {"model": MODEL, "prompt": "hi", "n": 16, "allowed_token_ids": [7] * 2**18}, 400),
    ("too many logit_bias entries", "/completions",
     {"model": MODEL, "prompt": "hi", "logit_bias": {str(t): -1 for t in range(2000)}}, 400),
    ("too many stop_token_ids", "/completions", {"model": MODEL, "prompt": "hi", "stop_token_ids": [2] * 5000}, 400),
    ("priority without the right to set it", "/completions", {"model": MODEL, "prompt": "hi", "priority": -1}, 403),
    ("request_id with a newline", "/completions",
     {"model": MODEL, "prompt": "hi", "request_id": "a\nforged line"}, 400),
    ("huge integer", "/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi", "extra": int("9" * 401)}]}, 400),
    ("choice bomb", "/completions",
     {"model": MODEL, "prompt": "hi", "guided_choice": [f"choice number {i}" for i in range(30_000)]}, 400),
    ("deep schema", "/completions", {"model": MODEL, "prompt": "hi", "guided_json": "[" * 50_000 + "]" * 50_000}, 400),
    ("long regex", "/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "guided_regex": "(a|b)" * 1000}, 400),
    ("answer over the budget", "/completions",
     {"model": MODEL, "prompt": "hi", "n": 16, "logprobs": 20, "max_tokens": 2000}, 400),
    ("tools of a million numbers", "/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tool_choice": "none",
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"enum": [1] * 1_000_000}}}]}, 400),
    ("detokenize over the context", "/detokenize", {"model": MODEL, "tokens": [42] * 200_000}, 400),
]
WEIGHTS = {"chat": 5, "completion": 3, "disconnect": 2, "tokenize": 1, "bad": 3, "crowd": 1, "intruder": 1,
           "stall": 1}
# (name, service, method path, streamed, whose token, the status it must end with): the gateway's
# token opens the processor only; a token nobody issued opens nothing.
INTRUSIONS: list[tuple[str, str, str, bool, str, grpc.StatusCode]] = [
    ("gateway token: worker InitializeCache", "worker", "/kvmesh.v1.Worker/InitializeCache", False, "gateway",
     grpc.StatusCode.PERMISSION_DENIED),
    ("gateway token: engine Generate", "engine", "/kvmesh.v1.Engine/Generate", True, "gateway",
     grpc.StatusCode.PERMISSION_DENIED),
    ("made-up token: processor Generate", "processor", "/kvmesh.v1.Processor/Generate", True, "made-up",
     grpc.StatusCode.UNAUTHENTICATED),
]


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)

    def bad(self, kind: str, what: str) -> None:
        self.counts[f"{kind}: unexpected"] += 1
        if len(self.unexpected) < 30:
            self.unexpected.append(f"{kind}: {what}")


async def chat(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    body = {"model": MODEL, "stream": True, "max_tokens": rng.randint(8, 48), "temperature": rng.choice([0, 0.8]),
            "messages": [{"role": "user", "content": f"Tell me about the number {rng.randint(0, 10**6)}."}]}
    async with client.stream("POST", "/chat/completions", json=body) as response:
        if response.status_code != 200:
            return tally.bad("chat", f"status {response.status_code}: {(await response.aread())[:200]!r}")
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    finishes = [json.loads(line[6:])["choices"][0].get("finish_reason") for line in lines[:-1]
                if json.loads(line[6:]).get("choices")]
    if not lines or lines[-1] != "data: [DONE]" or not any(finishes):
        return tally.bad("chat", f"stream ended without [DONE] or a finish_reason: {lines[-2:]}")
    tally.counts["chat"] += 1


async def completion(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    max_tokens = rng.randint(4, 32)
    prompt = LONG_PROMPT if rng.random() < 0.3 else f"Count from {rng.randint(0, 100)}:"
    response = await client.post("/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                       "temperature": 0, "ignore_eos": True})
    if response.status_code != 200 or response.json()["usage"]["completion_tokens"] != max_tokens:
        return tally.bad("completion", f"status {response.status_code}: {response.text[:200]}")
    tally.counts["completion"] += 1


async def disconnect(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    body = {"model": MODEL, "stream": True, "max_tokens": 200, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Write a long story."}]}
    async with client.stream("POST", "/chat/completions", json=body) as response:
        if response.status_code != 200:
            return tally.bad("disconnect", f"status {response.status_code}")
        chunks = 0
        async for _ in response.aiter_lines():
            chunks += 1
            if chunks >= rng.randint(2, 6):
                break  # leaving the block closes the connection mid-stream
    tally.counts["disconnect"] += 1


async def tokenize(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    response = await client.post(client.base_url.copy_with(path="/tokenize"), json={"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}]})
    if response.status_code != 200 or not response.json().get("tokens"):
        return tally.bad("tokenize", f"status {response.status_code}: {response.text[:200]}")
    tally.counts["tokenize"] += 1


async def bad(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    name, path, body, status = rng.choice(BAD_REQUESTS)
    content = body if isinstance(body, str) else json.dumps(body)
    url = client.base_url.copy_with(path=path) if path in ROOT_PATHS else path
    response = await client.post(url, content=content, headers={"Content-Type": "application/json"})
    if response.status_code != status or "error" not in response.json():
        return tally.bad("bad", f"{name}: status {response.status_code} (expected {status}): {response.text[:200]}")
    tally.counts[f"bad: {name}"] += 1


async def crowd(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    source = f"127.0.{rng.randint(1, 254)}.{rng.randint(1, 254)}"  # one client, none of the other loops
    host, port = client.base_url.host, client.base_url.port
    opened: list[asyncio.StreamWriter] = []
    try:
        for _ in range(PER_CLIENT + 1):
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
            opened.append(writer)
        answer = await asyncio.wait_for(reader.read(), 10)  # the last one's, then it is closed
    finally:
        for writer in opened:
            writer.close()
    if not answer.startswith(b"HTTP/1.1 429") or b"--max-connections-per-client" not in answer:
        return tally.bad("crowd", f"connection {PER_CLIENT + 1} of one client: {answer[:200]!r}")
    tally.counts["crowd"] += 1


async def stall(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    outcome = await asyncio.to_thread(_stalled_stream, client.base_url.host, client.base_url.port)
    if outcome != "cut off":
        return tally.bad("stall", outcome)
    tally.counts["stall"] += 1


def _stalled_stream(host: str, port: int) -> str:
    """"cut off" when the gateway reset the connection before [DONE]; else what happened."""
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": 1500, "ignore_eos": True, "logprobs": True,
                       "top_logprobs": 20, "messages": [{"role": "user", "content": "Count to a thousand."}]}).encode()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s" % (API_KEY.encode(), len(body), body))
        deadline = time.monotonic() + STALL_DEADLINE
        while time.monotonic() < deadline:
            time.sleep(1.0)
            error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)  # the reset, once it came
            if error:
                return "cut off"
        sock.settimeout(10)  # never cut: read it whole, to say what it was
        received = bytearray()
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except OSError as exc:
            return f"read after {STALL_DEADLINE:.0f} s failed ({exc}) yet no reset came: {bytes(received[:120])!r}"
    return f"never cut off in {STALL_DEADLINE:.0f} s; read {len(received)} bytes, [DONE]: {b'[DONE]' in received}"


@dataclass(frozen=True)
class Internal:
    """The internal services' addresses, by name, and the tokens the intruder tries, by whose."""

    addresses: dict[str, str]
    credentials: dict[str, RpcSecurity]

    @classmethod
    def of(cls, services: dict[str, dict[str, Any]]) -> Internal:
        argv = Path(f"/proc/{services['gateway']['pid']}/cmdline").read_bytes().split(b"\0")
        token_file = Path(argv[argv.index(b"--gateway-token-file") + 1].decode())
        gateway = RpcSecurity.load(SecurityConfig(gateway_token_file=token_file), GATEWAY)
        # serve keeps every role's token beside the gateway's.
        processor = RpcSecurity.load(SecurityConfig(processor_token_file=token_file.parent / "processor-token"),
                                     PROCESSOR)
        return cls({name: services[name]["address"] for name in ("processor", "engine", "worker")},
                   {"gateway": gateway, "processor": processor, "made-up": RpcSecurity("a-token-nobody-issued")})


async def intruder(internal: Internal, client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    name, service, method, streamed, whose, expected = rng.choice(INTRUSIONS)
    security = internal.credentials[whose]
    async with grpc.aio.insecure_channel(internal.addresses[service]) as channel:
        call = (channel.unary_stream if streamed else channel.unary_unary)(method)
        try:
            answer = call(b"", metadata=security.call_metadata, timeout=30)
            if streamed:
                async for _ in answer:
                    pass
            else:
                await answer
            code = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as error:
            code = error.code()
    if code != expected:
        return tally.bad("intruder", f"{name}: {code.name} (expected {expected.name})")
    tally.counts[f"intruder: {name}"] += 1


SCENARIOS = {"chat": chat, "completion": completion, "disconnect": disconnect, "tokenize": tokenize, "bad": bad,
             "crowd": crowd, "stall": stall}


async def client_loop(api: str, seed: int, deadline: float, tally: Tally, scenarios: dict[str, Any]) -> None:
    rng = random.Random(seed)
    names, weights = zip(*WEIGHTS.items())
    async with httpx.AsyncClient(base_url=api, timeout=180, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        while time.monotonic() < deadline:
            name = rng.choices(names, weights)[0]
            try:
                await scenarios[name](client, rng, tally)
            except Exception as exc:  # a failed connection or a timeout is what a soak must count
                tally.bad(name, f"{type(exc).__name__}: {exc}")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


async def sample_memory(pids: dict[str, int], every: float, samples: list[tuple[float, dict[str, float]]],
                        start: float) -> None:
    while True:
        samples.append((time.monotonic() - start, {name: rss_mb(pid) for name, pid in pids.items()}))
        await asyncio.sleep(every)


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def engine_left_over(api: str) -> dict[str, float]:
    """Once idle (waits up to 60 s): requests still running or waiting, KV usage (must all be 0)."""
    root = api.removesuffix("/v1")
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(120):
            text = (await client.get(f"{root}/metrics")).text
            left = {name: metric(text, f"vllm:{name}") for name in
                    ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}
            if not any(left.values()):
                break
            await asyncio.sleep(0.5)
    return left


async def soak(api: str, pids: dict[str, int], internal: Internal, args: argparse.Namespace) -> dict[str, Any]:
    tally, samples = Tally(), []
    start = time.monotonic()
    sampler = asyncio.create_task(sample_memory(pids, 15.0, samples, start))
    scenarios = {**SCENARIOS, "intruder": functools.partial(intruder, internal)}
    await asyncio.gather(*(client_loop(api, args.seed + i, start + args.duration, tally, scenarios)
                           for i in range(args.clients)))
    sampler.cancel()
    samples.append((time.monotonic() - start, {name: rss_mb(pid) for name, pid in pids.items()}))
    warm = next((s for t, s in samples if t >= args.warmup), samples[0][1])
    last = samples[-1][1]
    return {
        "duration_s": round(time.monotonic() - start), "clients": args.clients,
        "requests": sum(v for k, v in tally.counts.items() if "unexpected" not in k),
        "counts": dict(sorted(tally.counts.items())), "unexpected": tally.unexpected,
        "rss_mb": {name: {"after_warmup": round(warm[name], 1), "end": round(last[name], 1),
                          "growth": round(last[name] - warm[name], 1), "peak": round(max(s[name] for _, s in samples), 1)}
                   for name in pids},
        "flat": all(last[name] - warm[name] <= args.rss_slack for name in pids),
        "left_over": await engine_left_over(api),
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [f"{result['duration_s']} s, {result['clients']} clients, {result['requests']} answers as expected, "
             f"{len(result['unexpected'])} unexpected; engine afterwards: {result['left_over']}", "",
             "| process | RSS after warm-up (MB) | at the end | growth | peak |", "| --- | --- | --- | --- | --- |"]
    for name, rss in result["rss_mb"].items():
        lines.append(f"| {name} | {rss['after_warmup']} | {rss['end']} | {rss['growth']:+} | {rss['peak']} |")
    lines += ["", "| outcome | count |", "| --- | --- |"]
    lines += [f"| {name} | {count} |" for name, count in result["counts"].items()]
    return "\n".join(lines + [f"unexpected: {u}" for u in result["unexpected"]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=6, help="concurrent client loops")
    parser.add_argument("--warmup", type=float, default=120.0, help="seconds before the memory baseline")
    parser.add_argument("--rss-slack", type=float, default=30.0, help="MB a process may grow after warm-up")
    parser.add_argument("--port", type=int, default=8321, help="port of the `kvmesh serve` this starts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    proc, ready, log = start_serve(["--kv-cache-memory", "256MiB", "--port", str(args.port), "--no-access-log",
                                    "--max-connections-per-client", str(PER_CLIENT), "--send-timeout", str(SEND_TIMEOUT)],
                                   env={"KVMESH_API_KEY": API_KEY})
    try:
        pids = {name: ready["services"][name]["pid"] for name in SERVICES}
        result = asyncio.run(soak(ready["api"], pids, Internal.of(ready["services"]), args))
    finally:
        stop_serve(proc)
    print(f"kvmesh serve's log: {log}")
    print(markdown(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    sys.exit(0 if not result["unexpected"] and result["flat"] else 1)


if __name__ == "__main__":
    main()
