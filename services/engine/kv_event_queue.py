"""The engine's side of the KV cache events (services/common/kv_events.py): a bounded queue the
block pool records into, on the engine-loop thread, for its one consumer. Without one attached, a
pool keeps no events.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from services.common.kv_events import AllBlocksCleared, KVCacheEvent


class KVEventBatch(NamedTuple):
    events: list[KVCacheEvent]
    # The queue overflowed since the last take: `events` starts with AllBlocksCleared, and blocks cached
    # before it may still be resident; a consumer that wants them back republishes the pool's state.
    resync: bool


class KVEventQueue:
    """The events of one block pool for its one consumer (the prefix-index publisher), bounded.

    A pool records events only when a queue is attached, so an engine nobody listens to keeps none.
    When the consumer falls `max_events` behind, the queue collapses to a single `AllBlocksCleared`:
    applied in order, the events still never leave a block in the index that the pool evicted (the
    index only misses blocks, which costs hits, never correctness), and memory stays bounded.
    `record` runs on the engine-loop thread, `take` on the consumer's; a lock keeps each whole.
    """

    def __init__(self, max_events: int = 10_000) -> None:
        if max_events < 2:
            raise ValueError(f"max_events must be at least 2, got {max_events}")
        self.max_events = max_events
        self.num_overflows = 0  # collapses since start (a counter for metrics)
        self._events: list[KVCacheEvent] = []
        self._resync = False
        self._closed = False
        self._lock = threading.Lock()

    def record(self, event: KVCacheEvent) -> None:
        with self._lock:
            if self._closed:
                return
            if len(self._events) >= self.max_events:
                self._events = [AllBlocksCleared()]
                self._resync = True
                self.num_overflows += 1
            self._events.append(event)

    def take(self) -> KVEventBatch:
        """Every event recorded since the last take, oldest first."""
        with self._lock:
            batch = KVEventBatch(self._events, self._resync)
            self._events, self._resync = [], False
        return batch

    def close(self) -> None:
        """The consumer is gone for good (it stopped publishing): drop what is queued, keep nothing more."""
        with self._lock:
            self._events, self._closed = [], True

    def __len__(self) -> int:
        return len(self._events)
