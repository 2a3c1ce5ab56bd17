"""Scheduling policies: the waiting queue's order and the choice of a preemption victim.

A new policy is a new object here, never another flag inside `Scheduler.schedule()`.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
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
    """First come, first served between client requests, and fair between them: the sequences of
    one request (its choices and prompts share a `group_id`) take turns with those of the others,
    round-robin, so that a request of many sequences cannot make a later small one wait for all of
    them. With one sequence per request this is plain FCFS. A preempted request goes back to the
    front (its group first in turn); the victim is the last running request (the latest admitted).

        groups: {A: [a3, a4, a5], B: [b0], C: [c0, c1]}    turn order A, B, C
        pop() -> a3, then b0, then c0, then a4, then c1, then a5
    """

    def __init__(self) -> None:
        # group id -> its waiting requests, in turn order (the group to pop from next first).
        self._groups: OrderedDict[str, deque[Request]] = OrderedDict()
        self._size = 0

    def add(self, request: Request) -> None:
        group = self._groups.get(request.group_id)
        if group is None:
            group = self._groups[request.group_id] = deque()
        group.append(request)
        self._size += 1

    def add_preempted(self, request: Request) -> None:
        group = self._groups.get(request.group_id)
        if group is None:
            group = self._groups[request.group_id] = deque()
        group.appendleft(request)
        self._groups.move_to_end(request.group_id, last=False)
        self._size += 1

    def peek(self) -> Request:
        return next(iter(self._groups.values()))[0]

    def pop(self) -> Request:
        group_id, group = next(iter(self._groups.items()))
        request = group.popleft()
        if group:
            self._groups.move_to_end(group_id)  # its next sequence waits for the other groups' turns
        else:
            del self._groups[group_id]
        self._size -= 1
        return request

    def remove(self, request: Request) -> None:
        # Only on abort, which is off the step's hot path.
        group = self._groups[request.group_id]
        group.remove(request)
        if not group:
            del self._groups[request.group_id]
        self._size -= 1

    def choose_victim(self, running: list[Request]) -> Request:
        return running[-1]

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Request]:
        """In the order pop() would take them."""
        queues = [list(g) for g in self._groups.values()]
        for turn in range(max(map(len, queues), default=0)):
            yield from (q[turn] for q in queues if turn < len(q))


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
