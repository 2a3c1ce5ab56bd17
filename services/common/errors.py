"""The errors that cross service boundaries, and the one table of how each travels over gRPC.

In-process a core raises the exception itself; over gRPC its servicer ends the call with the
exception's status code (status_of) and the client raises the same exception again (raising_errors),
so a caller sees the same exception whichever implementation of a client it holds. Servicer
methods are decorated with `answers_with_status`; client calls run inside `raising_errors()`.

    exception               status code            raised for
    ModelNotFoundError      NOT_FOUND              a model the processor does not serve
    ValueError              INVALID_ARGUMENT       invalid input (limits, ranges, a request id in use)
    EngineOverloadedError   RESOURCE_EXHAUSTED     the engine's queue is full; retry later
    EngineDeadError         FAILED_PRECONDITION    the engine stopped serving (its worker failed, or
                                                   it shuts down); a supervisor restarts it
    ConnectionError         UNAVAILABLE            a service cannot be reached, or is not serving
    TimeoutError            DEADLINE_EXCEEDED      a call outlived its deadline
    InternalError           INTERNAL               anything else: a failure of the service's own

Anything outside the table is an InternalError on the wire, with a message that names nothing of
the service's insides (the service logs the exception with its traceback). The gateway maps these
same exceptions to HTTP (services/gateway/errors.py).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import aclosing, contextmanager
from typing import NamedTuple, TypeVar

import grpc

logger = logging.getLogger(__name__)
Method = TypeVar("Method", bound=Callable)


class EngineOverloadedError(RuntimeError):
    """The engine refuses a new request: it already holds as many as it may queue
    (SchedulerConfig.max_num_waiting). Nothing of the request was kept; the caller may retry later."""


class EngineDeadError(RuntimeError):
    """The engine has stopped serving (its worker failed, or it shut down): every open stream ends
    with this, and so does every later request."""


class InternalError(RuntimeError):
    """A service failed for a reason of its own; the message says no more (its log does)."""


class ModelNotFoundError(LookupError):
    """A request names a model this processor does not serve; the message is the name alone."""


# The one table. status_of takes the first row `exc` is an instance of (subclasses before their
# bases); exception_of the row of the status code.
ERRORS: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (EngineOverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineDeadError, grpc.StatusCode.FAILED_PRECONDITION),
    (InternalError, grpc.StatusCode.INTERNAL),
    (ModelNotFoundError, grpc.StatusCode.NOT_FOUND),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConnectionError, grpc.StatusCode.UNAVAILABLE),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
)
_EXCEPTION_OF_CODE = {code: cls for cls, code in ERRORS}
# gRPC's own way of saying "not reachable now": the server stopped mid-call.
_EXCEPTION_OF_CODE[grpc.StatusCode.CANCELLED] = ConnectionError
INTERNAL_MESSAGE = "internal error"


class RpcStatus(NamedTuple):
    code: grpc.StatusCode
    details: str


def status_of(exc: BaseException) -> RpcStatus:
    """The status a servicer ends a failed call with (`await context.abort(*status_of(exc))`).
    An exception outside the table is logged here, with its traceback, and answered INTERNAL."""
    for cls, code in ERRORS:
        if isinstance(exc, cls):
            return RpcStatus(code, str(exc))
    logger.error("call failed", exc_info=exc)
    return RpcStatus(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)


def exception_of(error: grpc.RpcError) -> Exception:
    """The exception a client raises for a failed call (grpc.RpcError of a sync or an aio stub)."""
    return exception_of_status(error.code(), error.details() or error.code().name)


def exception_of_status(code: grpc.StatusCode, details: str) -> Exception:
    """The exception for a status that came another way than a gRPC call (the worker's step channel)."""
    cls = _EXCEPTION_OF_CODE.get(code)
    if cls is None:  # a status no kvmesh servicer sends (UNIMPLEMENTED: a server of another version)
        return InternalError(f"{code.name}: {details}")
    return cls(details)


@contextmanager
def raising_errors() -> Iterator[None]:
    """Around a client's stub calls (sync or async, streams too): a failed call raises exception_of."""
    try:
        yield
    except grpc.RpcError as error:
        raise exception_of(error) from None


def answers_with_status(method: Method) -> Method:
    """Decorates a servicer method (a coroutine, or an async generator for a server stream): an
    exception it raises ends the call with status_of. A stream is closed before the call ends, so
    its `finally` (an engine request's abort) runs at once."""
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self, request, context):
            try:
                async with aclosing(method(self, request, context)) as messages:
                    async for message in messages:
                        yield message
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await context.abort(*status_of(exc))
        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await context.abort(*status_of(exc))
    return unary
