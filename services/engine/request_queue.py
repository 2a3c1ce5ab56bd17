"""Scheduling policies: the waiting queue's order and the choice of a preemption victim.

A new policy is a new object here, never another flag inside `Scheduler.schedule()`.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from services.engine.request import Request


class RequestQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def add_preempted(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def choose_victim(self, running: list[Request]) -> Request: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSRequestQueue:
    """First come, first served; a preempted request goes back to the front; the victim is the
    last running request (the latest admitted)."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        # Only on abort, which is off the step's hot path.
        self._queue.remove(request)

    def choose_victim(self, running: list[Request]) -> Request:
        return running[-1]

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Lowest `priority` value first, then arrival; the victim is the lowest-priority, latest request."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()
        self._removed: set[int] = set()  # ids of heap entries removed lazily (aborts)
        self._entry: dict[str, int] = {}

    def _push(self, request: Request) -> None:
        seq = next(self._counter)
        self._entry[request.request_id] = seq
        heapq.heappush(self._heap, (request.priority, request.arrival_time, seq, request))

    def _drop_removed(self) -> None:
        while self._heap and self._heap[0][2] in self._removed:
            self._removed.discard(heapq.heappop(self._heap)[2])

    def add(self, request: Request) -> None:
        self._push(request)

    def add_preempted(self, request: Request) -> None:
        self._push(request)  # its (priority, arrival) puts it back where it belongs

    def peek(self) -> Request:
        self._drop_removed()
        return self._heap[0][3]

    def pop(self) -> Request:
        self._drop_removed()
        request = heapq.heappop(self._heap)[3]
        del self._entry[request.request_id]
        return request

    def remove(self, request: Request) -> None:
        self._removed.add(self._entry.pop(request.request_id))

    def choose_victim(self, running: list[Request]) -> Request:
        return max(running, key=lambda r: (r.priority, r.arrival_time))

    def __len__(self) -> int:
        return len(self._entry)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap) if entry[2] not in self._removed)


def make_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; choose fcfs or priority")
