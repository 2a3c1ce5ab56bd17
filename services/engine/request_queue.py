"""Scheduling policies: the waiting queue's order and the choice of a preemption victim.

A new policy is a new object here, never another flag inside `Scheduler.schedule()`.
"""

from __future__ import annotations

import heapq
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


Turns = OrderedDict[str, OrderedDict[str, deque[Request]]]  # tenant -> group -> its waiting requests


class FCFSRequestQueue:
    """First come, first served, in turns at two levels: between tenants (the API keys requests
    come with), then within a tenant between its client requests (the sequences of one request,
    its choices and prompts, share a `group_id`). A tenant sending many requests, or one request of
    many sequences, cannot make another tenant's request wait for all of them. With one tenant and
    one sequence per request this is plain FCFS. A preempted request goes back to the front (its
    tenant and group first in turn); the victim is the last running request (the latest admitted).

        tenants: {K: {A: [a3, a4], B: [b0]}, L: {C: [c0, c1]}}    turn order K, L; within K: A, B
        pop() -> a3 (K's A), c0 (L's C), b0 (K's B), c1, a4
    """

    def __init__(self) -> None:
        # In turn order at both levels: the tenant to pop from next first, and its group next first.
        self._tenants: Turns = OrderedDict()
        self._size = 0

    def _group(self, request: Request, front: bool) -> deque[Request]:
        groups = self._tenants.get(request.tenant_id)
        if groups is None:
            groups = self._tenants[request.tenant_id] = OrderedDict()
        group = groups.get(request.group_id)
        if group is None:
            group = groups[request.group_id] = deque()
        if front:
            self._tenants.move_to_end(request.tenant_id, last=False)
            groups.move_to_end(request.group_id, last=False)
        return group

    def add(self, request: Request) -> None:
        self._group(request, front=False).append(request)
        self._size += 1

    def add_preempted(self, request: Request) -> None:
        self._group(request, front=True).appendleft(request)
        self._size += 1

    def peek(self) -> Request:
        groups = next(iter(self._tenants.values()))
        return next(iter(groups.values()))[0]

    def pop(self) -> Request:
        self._size -= 1
        return _take_turn(self._tenants)

    def remove(self, request: Request) -> None:
        # Only on abort, which is off the step's hot path.
        groups = self._tenants[request.tenant_id]
        group = groups[request.group_id]
        group.remove(request)
        if not group:
            del groups[request.group_id]
            if not groups:
                del self._tenants[request.tenant_id]
        self._size -= 1

    def choose_victim(self, running: list[Request]) -> Request:
        return running[-1]

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Request]:
        """In the order pop() would take them."""
        turns: Turns = OrderedDict((tenant, OrderedDict((g, deque(q)) for g, q in groups.items()))
                                   for tenant, groups in self._tenants.items())
        while turns:
            yield _take_turn(turns)


def _take_turn(turns: Turns) -> Request:
    """The first request of the first group of the first tenant, whose turns then pass: the group
    to the back of its tenant's, the tenant to the back of all (each dropped once empty)."""
    tenant, groups = next(iter(turns.items()))
    group_id, group = next(iter(groups.items()))
    request = group.popleft()
    if group:
        groups.move_to_end(group_id)
    else:
        del groups[group_id]
    if groups:
        turns.move_to_end(tenant)
    else:
        del turns[tenant]
    return request


class PriorityRequestQueue:
    """Lowest `priority` value first; at one priority, the tenants and their requests take turns as
    in FCFSRequestQueue. The victim is the lowest-priority, latest request."""

    def __init__(self) -> None:
        self._levels: dict[int, FCFSRequestQueue] = {}  # by priority, each non-empty
        self._priorities: list[int] = []  # a heap of the levels' priorities
        self._size = 0

    def _level(self, priority: int) -> FCFSRequestQueue:
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = FCFSRequestQueue()
            heapq.heappush(self._priorities, priority)
        return level

    def _drop_if_empty(self, priority: int) -> None:
        if not self._levels[priority]:
            del self._levels[priority]
            self._priorities.remove(priority)  # one entry per distinct priority: a short list
            heapq.heapify(self._priorities)

    def add(self, request: Request) -> None:
        self._level(request.priority).add(request)
        self._size += 1

    def add_preempted(self, request: Request) -> None:
        self._level(request.priority).add_preempted(request)
        self._size += 1

    def peek(self) -> Request:
        return self._levels[self._priorities[0]].peek()

    def pop(self) -> Request:
        priority = self._priorities[0]
        request = self._levels[priority].pop()
        self._drop_if_empty(priority)
        self._size -= 1
        return request

    def remove(self, request: Request) -> None:
        self._levels[request.priority].remove(request)
        self._drop_if_empty(request.priority)
        self._size -= 1

    def choose_victim(self, running: list[Request]) -> Request:
        return max(running, key=lambda r: (r.priority, r.arrival_time))

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Request]:
        for priority in sorted(self._levels):
            yield from self._levels[priority]


def make_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; choose fcfs or priority")
