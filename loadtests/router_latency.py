"""The router's own cost (the goal: "routing p99 < 2 ms with Redis on loopback"), alone on the machine.

routing_bench.py measures routing inside a whole fleet on this 2-core machine, where the processor
shares the cores with two workers busy computing: its percentiles there include the time the
processor waits for a core. This measures the decision itself, as the processor makes it: the
kv-aware `Router` (services/processor/router.py) over a processor's `PrefixIndexReplica` of a
`RedisPrefixIndex` on a redis-server of our own (free loopback port; `--index redis`: Redis itself,
one round trip a lookup), the index filled as --engines engines with --blocks-per-engine cached
blocks each would leave it (prompts of --prompt-tokens tokens sharing --prefixes system prompts),
then --requests routing decisions, one at a time, each for a prompt that shares one of the prefixes
(a hit) or not (a miss, every --miss-every-th). Each decision: hash the prompt's block chain, one
index lookup (in memory), the cost per engine. Percentiles are exact (perf_counter per
decision), not bucketed.

    .venv/bin/python -m loadtests.router_latency                 # 2 engines x 10,000 blocks, 2,000 decisions
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass

from loadtests.serving_bench import machine, percentile
from services.common.clients import EngineInfo
from services.common.config import RoutingConfig
from services.common.engine_output import EngineCoreRequest
from services.common.hashing import hash_token_blocks
from services.common.kv_events import BlockStored
from services.common.sampling_params import SamplingParams
from services.prefix_index import EngineLoad, PrefixIndexReplica, RedisPrefixIndex
from services.processor.router import Router
from tests.redis_server import RedisServer

BLOCK_SIZE = 16
MODEL_ID = "bench"


@dataclass(slots=True)
class Engine:
    """What the router reads of an engine (services/processor/router.py Candidate)."""

    address: str
    index_id: str
    in_flight: int
    info: EngineInfo | None


async def fill(index: RedisPrefixIndex, engines: list[Engine], prefixes: list[list[int]], blocks_per_engine: int,
               prompt_tokens: int, rng: random.Random) -> None:
    """Prefix p is held by engine p % len(engines) (with the rest of a prompt of its own); the rest of each
    engine's blocks are prompts of their own."""
    for e, engine in enumerate(engines):
        own = [p for i, p in enumerate(prefixes) if i % len(engines) == e]
        stored = 0
        while stored < blocks_per_engine:
            prompt = own.pop() if own else []
            prompt = prompt + [rng.randrange(1000, 40000) for _ in range(prompt_tokens - len(prompt))]
            chain = hash_token_blocks(prompt, BLOCK_SIZE, MODEL_ID)
            await index.apply(engine.index_id, 1, [BlockStored(chain, None, prompt[:len(chain) * BLOCK_SIZE],
                                                              BLOCK_SIZE)])
            stored += len(chain)
        await index.heartbeat(engine.index_id, 1, EngineLoad(e, 0, 100, 0.5))


async def run(args: argparse.Namespace) -> str:
    rng = random.Random(args.seed)
    server = RedisServer().start()
    try:
        index = RedisPrefixIndex.connect(server.url, timeout_s=0.5)
        info = EngineInfo(MODEL_ID, "/nowhere", 8192, BLOCK_SIZE)
        engines = [Engine(f"127.0.0.1:{5000 + i}", f"127.0.0.1:{5000 + i}", 0, info) for i in range(args.engines)]
        prefixes = [[rng.randrange(1000, 40000) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)]
        await fill(index, engines, prefixes, args.blocks_per_engine, args.prompt_tokens, rng)
        lookups: RedisPrefixIndex | PrefixIndexReplica = index
        if args.index == "replica":  # what a processor routes by
            lookups = PrefixIndexReplica.connect(server.url, timeout_s=0.5)
            lookups.start()
            await lookups.sync()
        router = Router(RoutingConfig(routing="kv-aware"), lookups, 0.5)
        params = SamplingParams(max_tokens=1)
        seconds: list[float] = []
        reasons: dict[str, int] = {}
        for i in range(args.warmup + args.requests):
            prefix = [] if i % args.miss_every == 0 else prefixes[i % len(prefixes)]
            prompt = prefix + [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens - len(prefix))]
            request = EngineCoreRequest(f"r{i}", prompt, params, eos_token_ids=(2,))
            await asyncio.sleep(0)  # between requests a processor's loop runs its other tasks (the replica's reader)
            start = time.perf_counter()
            route = await router.route(engines, request)
            elapsed = time.perf_counter() - start
            if i >= args.warmup:
                seconds.append(elapsed)
                reasons[route.reason] = reasons.get(route.reason, 0) + 1
        if lookups is not index:
            await lookups.close()
        await index.close()
    finally:
        server.close()
    ms = [s * 1e3 for s in seconds]
    return (f"router_latency: {args.requests} kv-aware decisions over a Redis index ({args.index}) of "
            f"{args.engines} engines x "
            f"{args.blocks_per_engine} blocks, {args.prompt_tokens}-token prompts: "
            f"p50 {percentile(ms, 50):.3f} ms, p90 {percentile(ms, 90):.3f} ms, p99 {percentile(ms, 99):.3f} ms, "
            f"max {max(ms):.3f} ms; reasons {dict(sorted(reasons.items()))}\nMachine: {machine()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.router_latency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--index", choices=("replica", "redis"), default="replica",
                        help="look prompts up in a processor's replica (what it does) or in Redis itself")
    parser.add_argument("--blocks-per-engine", type=int, default=10_000)
    parser.add_argument("--prefixes", type=int, default=8, help="distinct system prompts")
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--miss-every", type=int, default=10, help="every n-th prompt shares no prefix")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.engines, args.requests, args.miss_every, args.prefixes) < 1 or args.prefix_tokens >= args.prompt_tokens:
        parser.error("counts must be positive and --prefix-tokens below --prompt-tokens")
    print(asyncio.run(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
