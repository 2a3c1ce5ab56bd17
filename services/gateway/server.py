"""The gateway service: the OpenAI-compatible HTTP API (uvicorn) over a processor reached by gRPC.

    python -m services.gateway.server --processor-address 127.0.0.1:50051 --port 8000

config -> GrpcProcessorClient -> create_app -> uvicorn (with services/gateway/connection_guard.py:
header and body deadlines, a connection cap, header limits) -> SIGTERM -> stop accepting, give
in-flight requests `--grace` seconds, end those still running with a 503 / an error event (which
aborts them down to the engine).
Flags come from services/common/config.py (GatewayConfig, Limits, ServingConfig); each falls back
to KVMESH_GATEWAY_<FIELD> (KVMESH_GATEWAY_PORT, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from dataclasses import replace
from types import FrameType

import uvicorn
from fastapi import FastAPI

from services.common.config import (GRAMMAR_COMPILE_FIELDS, GatewayConfig, GrammarLimits, Limits, FleetConfig,
                                    LoRAConfig, SecurityConfig, ServingConfig)
from services.common.flags import add_flags, build
from services.common.metrics import GrpcMetrics
from services.common.ports import DEFAULT_PORTS
from services.common.rpc.security import GATEWAY, RpcSecurity
from services.gateway.app import ApiOptions, create_app, end_requests
from services.gateway.auth import api_keys_from, api_keys_from_file
from services.gateway.connection_guard import quiet_accept_errors, uvicorn_options
from services.gateway.metrics import GatewayMetrics
from services.processor.client import GrpcProcessorClient

logger = logging.getLogger("uvicorn.error")  # uvicorn configures its own loggers only

DEFAULT_PORT = DEFAULT_PORTS["gateway"].port
ENV_PREFIX = "KVMESH_GATEWAY"  # KVMESH_GATEWAY_PORT for --port, ...


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
        quiet_accept_errors(self.loop)
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)  # a signal handler: only hand the work to the loop
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.call_later, max(0.0, self.grace - END_MARGIN), self._end_requests)

    def _end_requests(self) -> None:
        count = end_requests(self.app, "the server is shutting down")
        if count:
            logger.warning("ended %d request(s) still running at shutdown", count)


async def serve(gateway: GatewayConfig, served_model_name: str | Sequence[str], serving: ServingConfig, limits: Limits = Limits(),
                api_keys: Sequence[str] = (), security: RpcSecurity = RpcSecurity(),
                grammar_limits: GrammarLimits = GrammarLimits(), *, lora: LoRAConfig = LoRAConfig()) -> None:
    """`security`: the internal token (and mTLS) of the calls to the processor. `lora`: the LoRA
    adapters requests may name as their model (the processor knows their base models too)."""
    priority_api_keys = api_keys_from_file(gateway.priority_api_key_file)
    if priority_api_keys and not api_keys:
        raise ValueError("--priority-api-key-file needs --api-key: without keys, every client may set priority")
    metrics = GatewayMetrics(gateway.aggregate_metrics)
    processor = GrpcProcessorClient(gateway.processor_address, timeout=gateway.timeout,
                                    metrics=GrpcMetrics(metrics.registry, "gateway"), security=security)
    app = create_app(processor, served_model_name, health_timeout=gateway.timeout, metrics=metrics, limits=limits,
                     api_keys=api_keys, priority_api_keys=priority_api_keys, session_header=gateway.session_header,
                     options=replace(ApiOptions.of(gateway), lora_modules=lora.lora_modules,
                                     allow_runtime_lora_updating=lora.allow_runtime_lora_updating),
                     grammar_limits=grammar_limits)
    # root_path: a proxy serves the API under it and strips it (vLLM's --root-path, the same ASGI root_path).
    config = uvicorn.Config(app, host=serving.host, port=serving.port, timeout_graceful_shutdown=serving.grace,
                            root_path=gateway.root_path,
                            access_log=gateway.access_log, log_level=gateway.log_level, **uvicorn_options(gateway))
    try:
        await GatewayServer(config, app, serving.grace).serve()
    finally:
        await processor.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh gateway", description="The kvmesh OpenAI-compatible gateway.")
    add_flags(parser, GatewayConfig, ENV_PREFIX)
    add_flags(parser, FleetConfig, ENV_PREFIX, only=["served_model_name"])
    add_flags(parser, Limits, ENV_PREFIX)
    add_flags(parser, GrammarLimits, ENV_PREFIX, exclude=GRAMMAR_COMPILE_FIELDS)
    add_flags(parser, ServingConfig, ENV_PREFIX, only=["host", "port", "grace"], defaults={"port": DEFAULT_PORT})
    add_flags(parser, SecurityConfig, ENV_PREFIX)
    add_flags(parser, LoRAConfig, ENV_PREFIX, only=["enable_lora", "lora_modules", "allow_runtime_lora_updating"])
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    gateway = build(parser, GatewayConfig, args)
    try:
        api_keys = api_keys_from(gateway.api_key, path=gateway.api_key_file)  # read once: rotate by restarting
    except (OSError, ValueError) as exc:
        parser.error(f"--api-key-file: {exc}")
    # The gateway takes the names alone (the processor has the models): each name stands for its model.
    names = args.served_model_name or args._default_served_model_name or FleetConfig().names
    fleet = build(parser, FleetConfig, args, model=tuple(names))
    lora = build(parser, LoRAConfig, args)
    try:
        lora.parents(fleet.names)
    except ValueError as exc:
        parser.error(str(exc))
    asyncio.run(serve(gateway, fleet.names, build(parser, ServingConfig, args),
                      build(parser, Limits, args), api_keys,
                      RpcSecurity.load(build(parser, SecurityConfig, args), GATEWAY),
                      build(parser, GrammarLimits, args), lora=lora))
    return 0


if __name__ == "__main__":
    sys.exit(main())
