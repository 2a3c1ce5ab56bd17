"""Adapters loaded in host memory, at most `capacity` (--max-cpu-loras), least recently used evicted:
a request's adapter is read from its folder once, not per request."""

from __future__ import annotations

from collections import OrderedDict

from services.common.lora import LoRARequest
from services.worker.lora.adapter import AdapterWeights


class AdapterCache:
    def __init__(self, capacity: int, max_lora_rank: int, base_config: dict) -> None:
        self.capacity = capacity
        self.max_lora_rank = max_lora_rank
        self.base_config = base_config
        self._adapters: OrderedDict[int, AdapterWeights] = OrderedDict()  # by id, least recently used first
        self._paths: dict[int, str] = {}  # every adapter ever loaded: an evicted one is read again

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def get(self, lora: LoRARequest) -> AdapterWeights:
        """`lora`'s weights, loaded on first use or after eviction (ValueError for a bad folder, or an
        id this worker knows under another folder)."""
        known = self._paths.get(lora.lora_int_id)
        if known is not None and known != lora.lora_path:
            raise ValueError(f"LoRA adapter id {lora.lora_int_id} is {known} on this worker, not {lora.lora_path}")
        weights = self._adapters.get(lora.lora_int_id)
        if weights is not None:
            self._adapters.move_to_end(lora.lora_int_id)
            return weights
        weights = AdapterWeights.load(lora.lora_int_id, lora.lora_path, self.max_lora_rank, self.base_config)
        self._paths[lora.lora_int_id] = lora.lora_path
        self._adapters[lora.lora_int_id] = weights
        while len(self._adapters) > self.capacity:
            self._adapters.popitem(last=False)
        return weights

    def remove(self, lora_id: int) -> None:
        """Forget an unloaded adapter: its weights and its folder (the id may come back with another)."""
        self._adapters.pop(lora_id, None)
        self._paths.pop(lora_id, None)
