"""The worker's LoRA state: adapters in host memory, the layers' slots, and each step's mapping of
request segments to slots (`LoRAMapping`, in the forward context for the LoRA layers to read).

    LoRAManager.wrap(model, ...)         LoRA layers around the model's projections
    manager.add(lora_request)            a new request's adapter, loaded once (ValueError: it fails alone)
    manager.remove(lora_id)              an unloaded adapter: slot, host memory and id dropped
    manager.mapping(lora_ids, query_start_loc) -> LoRAMapping | None   once per step; None: no adapter
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from services.common.lora import LoRARequest
from services.worker.lora.cpu_cache import AdapterCache
from services.worker.lora.layers import SlotShape, wrap_layers
from services.worker.lora.slots import SlotManager


class LoRAMapping(NamedTuple):
    """One step's segments: segment i is rows seg_indptr[i]:seg_indptr[i+1] of the flat batch, one or
    more neighbouring requests that run with slot seg_slots[i] (-1: the base model)."""

    seg_indptr: torch.Tensor  # [num_segments + 1] int32, from 0 to the step's tokens
    seg_slots: torch.Tensor  # [num_segments] int32


class LoRAManager:
    def __init__(self, model: nn.Module, slots: SlotShape, max_cpu_loras: int, base_config: dict) -> None:
        """`slots`: the layers' slots (--max-loras, --max-lora-rank, the model's dtype and device)."""
        self.layers = wrap_layers(model, slots)
        self.cache = AdapterCache(max_cpu_loras, slots.max_rank, base_config)
        self.slots = SlotManager(slots.max_loras)
        self.device = slots.device
        self._requests: dict[int, LoRARequest] = {}  # by id: how to load an adapter again after eviction

    def add(self, lora: LoRARequest) -> None:
        """Load a new request's adapter (ValueError for a bad folder or a clashing id)."""
        self.cache.get(lora)
        self._requests[lora.lora_int_id] = lora

    def remove(self, lora_id: int) -> None:
        """Drop an unloaded adapter: its slot, its host memory, how to load it. No request of the
        batch runs with it (the engine sends the removal once the last one finished)."""
        self.slots.release(lora_id)
        self.cache.remove(lora_id)
        self._requests.pop(lora_id, None)

    @property
    def num_held(self) -> tuple[int, int, int]:
        """Adapters in slots, in host memory, and known by id: all 0 once every one is unloaded."""
        return (sum(i is not None for i in self.slots.slot_ids), len(self.cache), len(self._requests))

    def mapping(self, lora_ids: np.ndarray, query_start_loc: torch.Tensor) -> LoRAMapping | None:
        """The step's mapping for requests running with adapters `lora_ids` ([num_reqs], 0: none) in
        flat-batch order; None when no request runs with one (the layers then add nothing)."""
        in_use = np.unique(lora_ids[lora_ids > 0])
        if not len(in_use):
            return None
        slots = self.slots.assign(in_use.tolist(), self._fill)
        req_slots = np.full(len(lora_ids), -1, dtype=np.int32)
        for lora_id, slot in slots.items():  # one pass per adapter of the step, at most max_loras
            req_slots[lora_ids == lora_id] = slot
        # Neighbouring requests of one slot make one segment (the runner puts an adapter's rows together).
        first = np.flatnonzero(np.r_[True, req_slots[1:] != req_slots[:-1]])
        bounds = query_start_loc.numpy()[np.r_[first, len(req_slots)]]
        return LoRAMapping(torch.from_numpy(bounds.astype(np.int32)).to(self.device),
                           torch.from_numpy(req_slots[first]).to(self.device))

    def _fill(self, slot: int, lora_id: int) -> None:
        weights = self.cache.get(self._requests[lora_id]).modules
        for layer_index, layers in enumerate(self.layers):
            per_layer = {module: ab for (index, module), ab in weights.items() if index == layer_index}
            for layer in {id(layer): layer for layer in layers.values()}.values():
                layer.fill(slot, per_layer)
