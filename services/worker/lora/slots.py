"""Which adapter sits in each of the layers' `max_loras` slots. A step's adapters keep theirs; one
not in a slot takes a free one, else the least recently used slot of an adapter not in the step."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class SlotManager:
    def __init__(self, max_loras: int) -> None:
        self.slot_ids: list[int | None] = [None] * max_loras  # the adapter id in each slot
        self._last_used = [0] * max_loras  # step counter of each slot's last use
        self._step = 0

    def assign(self, lora_ids: Sequence[int], fill: Callable[[int, int], None]) -> dict[int, int]:
        """A slot per id in `lora_ids` (distinct), calling `fill(slot, lora_id)` for each adapter that
        enters one. ValueError when the step has more adapters than slots."""
        if len(lora_ids) > len(self.slot_ids):
            raise ValueError(f"a step with {len(lora_ids)} LoRA adapters; this worker has {len(self.slot_ids)} "
                             "slots (--max-loras)")
        self._step += 1
        wanted = set(lora_ids)
        slots = {lora_id: slot for slot, lora_id in enumerate(self.slot_ids) if lora_id in wanted}
        for lora_id in lora_ids:
            if lora_id in slots:
                continue
            free = [s for s, held in enumerate(self.slot_ids) if held is None or held not in wanted]
            slot = min(free, key=lambda s: (self.slot_ids[s] is not None, self._last_used[s]))
            fill(slot, lora_id)
            self.slot_ids[slot] = lora_id
            slots[lora_id] = slot
        for slot in slots.values():
            self._last_used[slot] = self._step
        return slots

    def release(self, lora_id: int) -> bool:
        """Free the slot of an unloaded adapter (the next adapter takes a free slot first); whether
        it held one."""
        if lora_id not in self.slot_ids:
            return False
        slot = self.slot_ids.index(lora_id)
        self.slot_ids[slot] = None
        self._last_used[slot] = 0
        return True
