"""EngineClient over gRPC (the in-process one is services.engine.async_engine.AsyncEngine).

A failed call raises what AsyncEngine raises for the same fault (services/common/errors.py):
ValueError, EngineOverloadedError, EngineDeadError; ConnectionError when the engine cannot be
reached, TimeoutError when a call outlives its deadline.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from services.common.clients import EngineInfo, EngineStats, PrefixMatch
from services.common.engine_output import EngineCoreOutput, EngineCoreRequest, PrefillProgress, PrefillTask
from services.common.errors import raising_errors
from services.common.metrics import GrpcMetrics
from services.common.rpc import convert
from services.common.rpc.client import AsyncGrpcClient
from services.common.rpc.kvmesh.v1 import engine_pb2, engine_pb2_grpc
from services.common.rpc.security import RpcSecurity


class GrpcEngineClient(AsyncGrpcClient):
    """`timeout` is the deadline of each unary call; `stream_timeout` of each Generate stream
    (the whole generation); `security` puts the internal token (and mTLS) on every call. Closing a
    generate() iterator early cancels the call, which aborts the request in the engine. Construct
    inside the running event loop."""

    def __init__(self, address: str, timeout: float = 10.0, stream_timeout: float = 3600.0,
                 metrics: GrpcMetrics | None = None, security: RpcSecurity = RpcSecurity()) -> None:
        super().__init__(address, security, metrics, timeout)
        self.stream_timeout = stream_timeout
        self._stub = engine_pb2_grpc.EngineStub(self._channel)

    async def info(self) -> EngineInfo:
        with raising_errors():
            reply = await self._stub.GetInfo(engine_pb2.GetEngineInfoRequest(), timeout=self.timeout)
        return convert.engine_info_from_proto(reply)

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        call = self._stub.Generate(convert.engine_request_to_proto(request), timeout=self.stream_timeout)
        try:
            with raising_errors():
                async for message in call:
                    yield convert.engine_output_from_proto(message)
        finally:
            call.cancel()  # a no-op once the stream has ended

    async def abort(self, request_ids: Sequence[str]) -> None:
        with raising_errors():
            await self._stub.Abort(engine_pb2.AbortRequest(request_ids=request_ids), timeout=self.timeout)

    async def stats(self) -> EngineStats:
        with raising_errors():
            reply = await self._stub.GetStats(engine_pb2.GetStatsRequest(), timeout=self.timeout)
        return convert.engine_stats_from_proto(reply)

    async def match_prefix(self, block_hashes: Sequence[bytes]) -> PrefixMatch:
        with raising_errors():
            reply = await self._stub.MatchPrefix(engine_pb2.MatchPrefixRequest(block_hashes=block_hashes),
                                                 timeout=self.timeout)
        return convert.prefix_match_from_proto(reply)

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        with raising_errors():
            await self._stub.LoadLoRAAdapter(engine_pb2.LoadLoRAAdapterRequest(lora_name=lora_name, lora_path=lora_path),
                                             timeout=self.timeout)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        with raising_errors():
            await self._stub.UnloadLoRAAdapter(engine_pb2.UnloadLoRAAdapterRequest(lora_name=lora_name),
                                               timeout=self.timeout)

    async def prefill(self, task: PrefillTask, timeout: float) -> AsyncIterator[PrefillProgress]:
        """Disaggregation: have this (prefill) engine compute a prompt and send its blocks;
        the token first, then `sent`. `timeout`: the whole call's deadline."""
        call = self._stub.Prefill(convert.prefill_task_to_proto(task), timeout=timeout)
        try:
            with raising_errors():
                async for message in call:
                    yield convert.prefill_progress_from_proto(message)
        finally:
            call.cancel()

    async def release_transfer(self, request_id: str) -> None:
        with raising_errors():
            await self._stub.ReleaseTransfer(engine_pb2.ReleaseTransferRequest(request_id=request_id),
                                             timeout=self.timeout)
