"""The adapters an engine serves, by name: each a LoRARequest (name, integer id, folder) that its
requests carry to the worker, the step limit that keeps a step within the worker's slots, and the
engine's copy of which adapters those slots hold.

    registry.resolve("sql") -> LoRARequest("sql", 1, "/adapters/sql")    ValueError for a name not served
    registry.load("chat", "/adapters/chat") -> LoRARequest("chat", 3, ...)   at run time, a fresh id
    registry.remove("chat") -> LoRARequest                               ModelNotFoundError: not served
    limit.begin(); limit.admits(request); limit.add(request)             at most max_loras adapters a step
    slots.step(lora_ids); slots.loaded -> ids in the worker's slots     the worker's SlotManager, replayed

Adapters come from --lora-modules (ids 1, 2, ... in flag order), from a runtime load (the next id,
never one used before: a worker knows an id by its folder until told it is gone) or, in-process,
from an LLM's LoRARequest (its own id), registered on first use.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.common.errors import ModelNotFoundError
from services.common.lora import LoRAModule, LoRARequest
from services.engine.request import Request
from services.worker.lora.slots import SlotManager


class LoRARegistry:
    def __init__(self, modules: Iterable[LoRAModule] = ()) -> None:
        self._by_name: dict[str, LoRARequest] = {}
        self._by_id: dict[int, LoRARequest] = {}
        self._next_id = 1  # above every id registered so far
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
        self._next_id = max(self._next_id, lora.lora_int_id + 1)

    def load(self, name: str, path: str) -> LoRARequest:
        """Register the folder `path` as `name` under a fresh id (vLLM's load_lora_adapter);
        ValueError when `name` is served already."""
        if name in self._by_name:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        lora = LoRARequest(name, self._next_id, path)
        self.add(lora)
        return lora

    def remove(self, name: str) -> LoRARequest:
        """Stop serving `name` (its id is never given out again); ModelNotFoundError when not served."""
        lora = self._by_name.pop(name, None)
        if lora is None:
            raise ModelNotFoundError(name)
        del self._by_id[lora.lora_int_id]
        return lora

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


class LoRASlots:
    """Which adapters the worker's `max_loras` slots hold, without asking it: the worker's own
    SlotManager fed the same adapter ids per step (services/worker/lora/manager.py takes a step's
    distinct ids in ascending order, as `step` does), so both assign the same slots."""

    def __init__(self, max_loras: int) -> None:
        self._slots = SlotManager(max_loras)

    def step(self, lora_ids: Iterable[int]) -> None:
        ids = sorted(set(lora_ids))
        if ids:
            self._slots.assign(ids, lambda slot, lora_id: None)

    def remove(self, lora_id: int) -> None:
        self._slots.release(lora_id)

    @property
    def loaded(self) -> tuple[int, ...]:
        return tuple(i for i in self._slots.slot_ids if i is not None)
