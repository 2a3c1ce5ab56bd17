"""ProcessorClient over gRPC (the in-process one is services.processor.async_processor.AsyncProcessor).

A failed call raises what AsyncProcessor raises for the same fault (services/common/errors.py),
with the server's message: the exceptions the gateway maps to HTTP.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from services.common.clients import EngineInfo, GenerateDelta, GenerateRequest, Tokenized, TokenizeRequest
from services.common.errors import raising_errors
from services.common.metrics import GrpcMetrics
from services.common.rpc import convert
from services.common.rpc.client import AsyncGrpcClient
from services.common.rpc.convert import generate_delta_from_proto, generate_request_to_proto
from services.common.rpc.kvmesh.v1 import engine_pb2, processor_pb2, processor_pb2_grpc
from services.common.rpc.security import RpcSecurity
from services.common.rpc.server import service_name

SERVICE_NAME = service_name(processor_pb2.DESCRIPTOR, "Processor")


class GrpcProcessorClient(AsyncGrpcClient):
    """`timeout` is the deadline of each unary call (and of the health check); `stream_timeout` of
    each Generate stream (the whole generation); `security` puts the internal token (and mTLS) on
    every call. Closing a generate() iterator early cancels the call, which aborts its engine
    requests. Construct inside the running event loop."""

    def __init__(self, address: str, timeout: float = 10.0, stream_timeout: float = 3600.0,
                 metrics: GrpcMetrics | None = None, security: RpcSecurity = RpcSecurity()) -> None:
        # Its health is the Processor service's, SERVING only while its engine is healthy.
        super().__init__(address, security, metrics, timeout, health_service=SERVICE_NAME)
        self.stream_timeout = stream_timeout
        self._stub = processor_pb2_grpc.ProcessorStub(self._channel)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        call = self._stub.Generate(generate_request_to_proto(request), timeout=self.stream_timeout)
        try:
            with raising_errors():
                async for message in call:
                    yield generate_delta_from_proto(message)
        finally:
            call.cancel()  # a no-op once the stream has ended

    async def tokenize(self, request: TokenizeRequest) -> Tokenized:
        with raising_errors():
            reply = await self._stub.Tokenize(convert.tokenize_request_to_proto(request), timeout=self.timeout)
        return convert.tokenized_from_proto(reply)

    async def detokenize(self, token_ids: Sequence[int], model: str = "") -> str:
        with raising_errors():
            reply = await self._stub.Detokenize(processor_pb2.DetokenizeRequest(token_ids=token_ids, model=model),
                                                timeout=self.timeout)
        return reply.text

    async def tokenizer_info(self, model: str = "") -> dict[str, Any]:
        with raising_errors():
            reply = await self._stub.GetTokenizerInfo(processor_pb2.GetTokenizerInfoRequest(model=model),
                                                      timeout=self.timeout)
        return json.loads(reply.config_json)

    async def model_info(self, model: str = "") -> EngineInfo:
        with raising_errors():
            reply = await self._stub.GetModelInfo(processor_pb2.GetModelInfoRequest(model=model), timeout=self.timeout)
        return convert.engine_info_from_proto(reply)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, base_model_name: str = "") -> None:
        adapter = engine_pb2.LoadLoRAAdapterRequest(lora_name=lora_name, lora_path=lora_path)
        with raising_errors():
            await self._stub.LoadLoRAAdapter(processor_pb2.LoadLoRAAdapterCall(adapter=adapter,
                                                                              base_model_name=base_model_name),
                                             timeout=self.timeout)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        with raising_errors():
            await self._stub.UnloadLoRAAdapter(engine_pb2.UnloadLoRAAdapterRequest(lora_name=lora_name),
                                               timeout=self.timeout)
