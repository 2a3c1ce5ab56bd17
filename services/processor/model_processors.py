"""A processor serving several models: one AsyncProcessor per served model name (its tokenizer, chat
template and pool of engines), each call handed to the one its `model` names.

    gateway ──model "a"──▶ ModelProcessors ──▶ AsyncProcessor "a" ──▶ EngineSet of a's engines
                   "b" ──▶                 ──▶ AsyncProcessor "b" ──▶ EngineSet of b's engines

A call that names no model goes to the first; one naming a LoRA adapter goes to its base model's, the
adapter's name as the request's lora_name; one naming a model not served is ModelNotFoundError
(NOT_FOUND on the wire). Adapters loaded at run time join the table once every engine of their base
model took them, and leave it at once when unloaded. A `ProcessorClient` itself, so the servicer is the same over one model or several.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from typing import Any

from services.common.clients import EngineInfo, GenerateDelta, GenerateRequest, Tokenized, TokenizeRequest
from services.common.errors import ModelNotFoundError
from services.processor.async_processor import AsyncProcessor


class ModelProcessors:
    """Implements `ProcessorClient` over one AsyncProcessor per served model name (first: the default)."""

    def __init__(self, processors: Mapping[str, AsyncProcessor], adapters: Mapping[str, str] | None = None) -> None:
        """`adapters`: LoRA adapters by name -> the served model they run on."""
        assert processors, "a processor serves at least one model"
        self.processors = dict(processors)
        self.adapters = dict(adapters or {})
        self.default = next(iter(self.processors))
        # One load or unload at a time: two loads of one name must not both pass the check below,
        # and the loser's rollback unload the winner's adapter.
        self._lora_lock = asyncio.Lock()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.processors)

    def of(self, model: str) -> AsyncProcessor:
        """The processor of `model` ("": the first); ModelNotFoundError for a model not served here."""
        processor = self.processors.get(self.adapters.get(model) or model or self.default)
        if processor is None:
            raise ModelNotFoundError(model)
        return processor

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        if request.model in self.adapters:  # a LoRA adapter: its base model's engines, with the adapter
            request.lora_name = request.model
        async with aclosing(self.of(request.model).generate(request)) as stream:
            async for delta in stream:
                yield delta

    async def tokenize(self, request: TokenizeRequest) -> Tokenized:
        return await self.of(request.model).tokenize(request)

    async def detokenize(self, token_ids: Sequence[int], model: str = "") -> str:
        return await self.of(model).detokenize(token_ids)

    async def tokenizer_info(self, model: str = "") -> dict[str, Any]:
        return await self.of(model).tokenizer_info()

    async def model_info(self, model: str = "") -> EngineInfo:
        return await self.of(model).model_info()

    async def load_lora_adapter(self, lora_name: str, lora_path: str, base_model_name: str = "") -> None:
        if not lora_name or not lora_path:
            raise ValueError("Both 'lora_name' and 'lora_path' must be provided.")
        base = base_model_name or self.default
        if base not in self.processors:
            raise ModelNotFoundError(base)
        async with self._lora_lock:
            if lora_name in self.processors or lora_name in self.adapters:
                raise ValueError(f"The lora adapter '{lora_name}' has already been loaded.")
            await self.processors[base].engine.load_lora_adapter(lora_name, lora_path)
            self.adapters[lora_name] = base

    async def unload_lora_adapter(self, lora_name: str) -> None:
        async with self._lora_lock:
            base = self.adapters.get(lora_name)
            if base is None:
                raise ModelNotFoundError(lora_name)
            del self.adapters[lora_name]  # no new request for it, whatever the engines answer
            try:
                await self.processors[base].engine.unload_lora_adapter(lora_name)
            except ModelNotFoundError:  # its engines restarted since: nothing left to unload
                pass

    async def is_healthy(self) -> bool:
        """True while some model has a healthy engine: a model whose engines are all down answers
        503 on its own requests, and must not take the others' away."""
        return any(await asyncio.gather(*(p.is_healthy() for p in self.processors.values())))

    def close(self) -> None:
        for processor in self.processors.values():
            processor.close()
