"""The adapters an engine serves, by name: each a LoRARequest (name, integer id, folder) that its
requests carry to the worker, and the step limit that keeps a step within the worker's slots.

    registry.resolve("sql") -> LoRARequest("sql", 1, "/adapters/sql")    ValueError for a name not served
    limit.begin(); limit.admits(request); limit.add(request)             at most max_loras adapters a step

Adapters come from --lora-modules (ids 1, 2, ... in flag order) or, in-process, from an LLM's
LoRARequest (its own id), registered on first use.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.common.lora import LoRAModule, LoRARequest
from services.engine.request import Request


class LoRARegistry:
    def __init__(self, modules: Iterable[LoRAModule] = ()) -> None:
        self._by_name: dict[str, LoRARequest] = {}
        self._by_id: dict[int, LoRARequest] = {}
        for i, module in enumerate(modules, start=1):
            self.add(LoRARequest(module.name, i, module.path))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def add(self, lora: LoRARequest) -> None:
        """Register `lora` (again: a no-op). ValueError when its name or id is another adapter's."""
        known = self._by_name.get(lora.lora_name) or self._by_id.get(lora.lora_int_id)
        if known is not None and known != lora:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} (id {lora.lora_int_id}, {lora.lora_path}) clashes "
                             f"with the registered {known.lora_name!r} (id {known.lora_int_id}, {known.lora_path})")
        self._by_name[lora.lora_name] = self._by_id[lora.lora_int_id] = lora

    def resolve(self, name: str) -> LoRARequest:
        lora = self._by_name.get(name)
        if lora is None:
            served = ", ".join(self._by_name) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r}; this engine serves: {served}")
        return lora


class LoRAStepLimit:
    """At most `max_loras` distinct adapters in one step (None: no limit, LoRA off). The scheduler
    asks before it schedules a request; the base model takes no slot."""

    def __init__(self, max_loras: int | None) -> None:
        self.max_loras = max_loras
        self._ids: set[int] = set()

    def begin(self) -> None:
        self._ids.clear()

    def admits(self, request: Request) -> bool:
        lora = request.lora_request
        if lora is None or self.max_loras is None:
            return True
        return lora.lora_int_id in self._ids or len(self._ids) < self.max_loras

    def add(self, request: Request) -> None:
        if request.lora_request is not None:
            self._ids.add(request.lora_request.lora_int_id)
