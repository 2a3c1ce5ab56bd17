"""The whole kvmesh stack in ONE process behind the OpenAI API: the serving benchmark's in-process path.

    .venv/bin/python -m loadtests.inprocess_server --port 8100 [--model smollm2] [--kv-cache-memory 1GiB]

gateway app (services.gateway.app.create_app) -> AsyncProcessor -> AsyncEngine -> InProcessWorkerClient
-> Worker, built as tests/services/test_gateway_stack.py builds it, served by uvicorn. The same
components `kvmesh serve` runs as four processes joined by gRPC, with the same defaults (flags named
as `kvmesh serve`'s), so the two differ only by the processes and the RPCs between them. SIGTERM or
Ctrl-C stops uvicorn (requests in flight get --grace seconds), then the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import uvicorn

from services.cli import parse_bytes
from services.common.config import ATTENTION_BACKENDS, DTYPES, CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from services.engine.async_engine import AsyncEngine
from services.gateway.app import create_app
from services.processor.async_processor import AsyncProcessor
from services.processor.processor import Processor
from services.processor.tokenizer import TokenizerInfo, load_tokenizer
from services.worker.client import InProcessWorkerClient
from services.worker.loader import resolve_model
from services.worker.worker import Worker


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtests.inprocess_server",
                                     description="The kvmesh stack in one process behind the OpenAI API.")
    parser.add_argument("--model", default="smollm2", help="model name, Hugging Face folder or GGUF file")
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=None, help="e.g. 1GiB")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--grace", type=float, default=5.0, help="seconds for requests in flight at shutdown")
    parser.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                        help="uvicorn's access log (on, as in `kvmesh serve`'s gateway)")
    return parser


async def serve(args: argparse.Namespace) -> None:
    model_path = resolve_model(args.model)
    cache_config = CacheConfig(kv_cache_memory=args.kv_cache_memory)
    worker = Worker(ModelConfig(model=str(model_path), dtype=args.dtype, device=args.device,
                                max_model_len=args.max_model_len),
                    cache_config, WorkerConfig(attention_backend=args.attention_backend))
    engine = await AsyncEngine.create(InProcessWorkerClient(worker, args.max_num_seqs), cache_config,
                                      SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                                      max_num_seqs=args.max_num_seqs))
    try:
        tokenizer = load_tokenizer(model_path)
        processor = Processor(tokenizer, TokenizerInfo.from_tokenizer(tokenizer, model_path),
                              engine.core.max_model_len)
        app = create_app(AsyncProcessor(processor, engine), args.served_model_name or args.model)
        config = uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=args.grace,
                                access_log=args.access_log)
        await uvicorn.Server(config).serve()
    finally:
        await engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    asyncio.run(serve(build_parser().parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
