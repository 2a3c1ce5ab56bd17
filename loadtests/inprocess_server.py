"""The whole kvmesh stack in ONE process behind the OpenAI API: the serving benchmark's in-process path.

    .venv/bin/python -m loadtests.inprocess_server --port 8100 [--model smollm2] [--kv-cache-memory 1GiB]

gateway app (services.gateway.app.create_app) over services.inprocess.AsyncStack (AsyncProcessor ->
AsyncEngine -> InProcessWorkerClient -> Worker), served by uvicorn. The same components `kvmesh
serve` runs as four processes joined by gRPC, with the same flags and defaults (services/common/
config.py), so the two differ only by the processes and the RPCs between them. SIGTERM or
Ctrl-C stops uvicorn (requests in flight get --grace seconds), then the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import uvicorn

from services.common.config import (
    CacheConfig,
    EngineArgs,
    GatewayConfig,
    ModelConfig,
    SchedulerConfig,
    ServingConfig,
    WorkerConfig,
)
from services.common.flags import add_flags, build
from services.gateway.app import create_app
from services.inprocess import AsyncStack

# What `kvmesh serve` takes, less what only the split stack has.
STACK_FLAGS = [(ModelConfig, {}), (CacheConfig, {}), (SchedulerConfig, {}),
               (WorkerConfig, {"exclude": ["max_num_seqs"]}), (GatewayConfig, {"only": ["access_log"]})]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtests.inprocess_server",
                                     description="The kvmesh stack in one process behind the OpenAI API.")
    for config_class, selection in STACK_FLAGS:
        add_flags(parser, config_class, None, **selection)
    add_flags(parser, ServingConfig, None, only=["host", "port", "grace"], defaults={"port": 8000})
    return parser


async def serve(engine_args: EngineArgs, gateway: GatewayConfig, serving: ServingConfig) -> None:
    stack = await AsyncStack.create(engine_args)
    try:
        app = create_app(stack.processor, engine_args.model.name)
        config = uvicorn.Config(app, host=serving.host, port=serving.port, timeout_graceful_shutdown=serving.grace,
                                access_log=gateway.access_log)
        await uvicorn.Server(config).serve()
    finally:
        await stack.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    scheduler = build(parser, SchedulerConfig, args)
    engine_args = EngineArgs(build(parser, ModelConfig, args), build(parser, CacheConfig, args), scheduler,
                             build(parser, WorkerConfig, args, max_num_seqs=scheduler.max_num_seqs))
    asyncio.run(serve(engine_args, build(parser, GatewayConfig, args), build(parser, ServingConfig, args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
