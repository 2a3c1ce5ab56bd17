"""LoRA adapter affinity: which engines of a pool a request for an adapter should go to, before the
routing policy picks among them (llm-d's and the Gateway API inference extension's LoRA affinity).

    engines that serve the adapter (an engine known not to serve it is left out)
      └─ hold it (in a slot, or requests of it running or queued)  -> those, unless the idlest of
                                                                      them is more than
                                                                      routing_imbalance requests
                                                                      busier than the idlest engine
      └─ none holds it                                             -> those with a slot to spare
                                                                      (fewer adapters running than
                                                                      --max-loras), else all

An engine's adapters are what it last reported (EngineStats.lora, re-read every STATE_MAX_AGE s),
joined with the adapters this processor sent it since that report began: a burst for a new adapter
follows its first request before the engine's next report says where the adapter went.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set as AbstractSet
from typing import Protocol, TypeVar

from services.common.clients import EngineStats

STATE_MAX_AGE = 0.25  # seconds an engine's reported adapters serve before they are read again


class LoRACandidate(Protocol):
    """What the affinity reads of an engine (services/processor/engine_set.py EngineMember)."""

    in_flight: int
    stats: EngineStats | None  # its last report; None: not read yet
    lora_in_flight: Mapping[str, int]  # adapter -> this processor's requests of it streaming there
    lora_routed: AbstractSet[str]  # adapters this processor sent it since its last report began


C = TypeVar("C", bound=LoRACandidate)


def serves(candidate: LoRACandidate, lora_name: str) -> bool:
    """False only when its last report says it does not serve `lora_name` (or serves no adapter)."""
    stats = candidate.stats
    return stats is None or (stats.lora is not None and lora_name in stats.lora.adapters)


def holds(candidate: LoRACandidate, lora_name: str) -> bool:
    stats = candidate.stats
    return (candidate.lora_in_flight.get(lora_name, 0) > 0 or lora_name in candidate.lora_routed
            or (stats is not None and stats.lora is not None and lora_name in stats.lora.active))


def has_free_slot(candidate: LoRACandidate) -> bool:
    stats = candidate.stats
    if stats is None or stats.lora is None:
        return True
    running = set(stats.lora.running) | {name for name, n in candidate.lora_in_flight.items() if n > 0}
    return len(running) < stats.lora.max_loras


def load(candidate: LoRACandidate) -> int:
    """Requests queued on it: this processor's in flight, or every processor's as it last reported."""
    stats = candidate.stats
    reported = stats.num_running + stats.num_waiting if stats is not None else 0
    return max(candidate.in_flight, reported)


def adapter_candidates(candidates: Sequence[C], lora_name: str, max_imbalance: int) -> list[C]:
    """The candidates a request for `lora_name` should be routed among (see the module)."""
    serving = [c for c in candidates if serves(c, lora_name)] or list(candidates)
    holders = [c for c in serving if holds(c, lora_name)]
    if holders:
        if min(map(load, holders)) - min(map(load, serving)) <= max_imbalance:
            return holders
        return serving
    return [c for c in serving if has_free_slot(c)] or serving
