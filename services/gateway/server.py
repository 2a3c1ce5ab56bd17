"""The gateway service: the OpenAI-compatible HTTP API (uvicorn) over a processor reached by gRPC.

    python -m services.gateway.server --processor-address 127.0.0.1:50051 --port 8000

config -> GrpcProcessorClient -> create_app -> uvicorn -> SIGTERM -> stop accepting, give
in-flight requests `--grace` seconds, end those still running with a 503 / an error event (which
aborts them down to the engine).
Every flag falls back to KVMESH_GATEWAY_<FLAG> (KVMESH_GATEWAY_PORT, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from types import FrameType

import uvicorn
from fastapi import FastAPI

from services.common.rpc.server import flag_default
from services.common.metrics import GrpcMetrics
from services.gateway.app import create_app, end_requests
from services.gateway.auth import API_KEY_ENV, api_keys_from
from services.gateway.limits import Limits
from services.gateway.metrics import GatewayMetrics
from services.processor.client import GrpcProcessorClient

logger = logging.getLogger("uvicorn.error")  # uvicorn configures its own loggers only

DEFAULT_PORT = 8000


END_MARGIN = 1.0  # seconds before the grace runs out at which the app ends what is still running


class GatewayServer(uvicorn.Server):
    """uvicorn, except that requests still running when the grace is nearly over are ended by the
    app (a 503 in OpenAI's shape, or an error event and [DONE]) rather than cut off by uvicorn."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, grace: float) -> None:
        super().__init__(config)
        self.app = app
        self.grace = grace
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)  # a signal handler: only hand the work to the loop
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.call_later, max(0.0, self.grace - END_MARGIN), self._end_requests)

    def _end_requests(self) -> None:
        count = end_requests(self.app, "the server is shutting down")
        if count:
            logger.warning("ended %d request(s) still running at shutdown", count)


async def serve(processor_address: str, served_model_name: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                timeout: float = 10.0, grace: float = 5.0, access_log: bool = True, log_level: str = "info",
                aggregate_metrics: Sequence[str] = (), limits: Limits = Limits(),
                api_keys: Sequence[str] = ()) -> None:
    metrics = GatewayMetrics(aggregate_metrics)
    processor = GrpcProcessorClient(processor_address, timeout=timeout,
                                    metrics=GrpcMetrics(metrics.registry, "gateway"))
    app = create_app(processor, served_model_name, health_timeout=timeout, metrics=metrics, limits=limits,
                     api_keys=api_keys)
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=grace, access_log=access_log,
                            log_level=log_level)
    try:
        await GatewayServer(config, app, grace).serve()
    finally:
        await processor.close()


def build_parser() -> argparse.ArgumentParser:
    def flag(name: str, default: object) -> object:
        return flag_default("KVMESH_GATEWAY", name, default)

    parser = argparse.ArgumentParser(prog="kvmesh gateway", description="The kvmesh OpenAI-compatible gateway.")
    parser.add_argument("--processor-address", default=flag("processor_address", "127.0.0.1:50051"))
    parser.add_argument("--served-model-name", default=flag("served_model_name", "smollm2"),
                        help="the model name clients send (and /v1/models lists)")
    parser.add_argument("--host", default=flag("host", "127.0.0.1"), help="interface to listen on")
    parser.add_argument("--port", type=int, default=flag("port", DEFAULT_PORT))
    parser.add_argument("--timeout", type=float, default=flag("timeout", 10.0),
                        help="deadline (s) of each unary processor call and of the health check")
    parser.add_argument("--grace", type=float, default=flag("grace", 5.0),
                        help="seconds for in-flight requests at shutdown")
    parser.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--log-level", default=flag("log_level", "info"))
    parser.add_argument("--api-key", action="append", default=None,
                        help=f"a key clients must send as `Authorization: Bearer <key>` (repeatable; default: "
                             f"the comma-separated keys in {API_KEY_ENV}; none: no authentication)")
    Limits.add_flags(parser, flag)
    parser.add_argument("--aggregate-metrics", type=_urls, default=flag("aggregate_metrics", ""),
                        help="comma-separated /metrics URLs of local services to merge into this /metrics "
                             "(set by `kvmesh serve`; never in a pod, where each is scraped on its own)")
    return parser


def _urls(text: str) -> list[str]:
    urls = [url.strip() for url in text.split(",") if url.strip()]
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise argparse.ArgumentTypeError(f"not an http(s) URL: {url!r}")
    return urls


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    asyncio.run(serve(args.processor_address, args.served_model_name, args.host, args.port, args.timeout,
                      args.grace, args.access_log, args.log_level, args.aggregate_metrics, Limits.from_args(args),
                      api_keys_from(args.api_key)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
