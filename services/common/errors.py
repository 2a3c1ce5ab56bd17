"""Errors that cross service boundaries with a meaning of their own (beyond ValueError for invalid
input), and how each travels: in-process as this exception, over gRPC as its status code."""

from __future__ import annotations


class EngineOverloadedError(RuntimeError):
    """The engine refuses a new request: it already holds as many as it may queue
    (SchedulerConfig.max_num_waiting). Nothing of the request was kept; the caller may retry later.

    gRPC: RESOURCE_EXHAUSTED, passed through by the processor. HTTP: 503 with Retry-After.
    """
