"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and the one mapping
from what the processor client raises to an HTTP status."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from starlette.exceptions import HTTPException
from starlette.responses import Response

from services.common.errors import EngineDeadError, EngineOverloadedError, InternalError, ModelNotFoundError
from services.gateway.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

RETRY_AFTER = 1  # seconds a client refused for overload is asked to wait (Retry-After)
# Seconds a client is asked to wait when a service behind the gateway is down: a supervisor
# restarts one in a few seconds (`kvmesh serve`, or Kubernetes), and clients that honour
# Retry-After (the OpenAI SDKs) then retry after it rather than at once.
UNAVAILABLE_RETRY_AFTER = 5


class APIError(Exception):
    """An error the gateway answers as it is (unknown model, a request it refuses)."""

    def __init__(self, status: int, message: str, type: str, param: str | None = None,
                 code: int | str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = dict(headers or {})

    def response(self) -> Response:
        """The JSON response; also an ASGI app, for middleware that answers before routing."""
        return Response(ErrorResponse(error=self.info).model_dump_json(), self.status, self.headers,
                        media_type="application/json")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model", "model_not_found")


# What a request can meet (api_error_of answers each): the app's handlers for these answer and keep
# the connection; anything else is a bug of ours, for Starlette's last-resort handler.
ANSWERED_ERRORS: tuple[type[Exception], ...] = (
    APIError, HTTPException, EngineOverloadedError, EngineDeadError, InternalError, ModelNotFoundError, ValueError,
    ConnectionError, TimeoutError)


def error_of(exc: BaseException) -> tuple[int, ErrorResponse]:
    """The status and body for `exc` (api_error_of)."""
    error = api_error_of(exc)
    return error.status, ErrorResponse(error=error.info)


def api_error_of(exc: BaseException) -> APIError:
    """What the client gets for `exc`: the processor client's exceptions (services/common/errors.py:
    ValueError for invalid input, EngineOverloadedError when the engine's queue is full,
    EngineDeadError when it stopped serving, ConnectionError when a service behind the gateway is
    unreachable or not serving, TimeoutError for a deadline that passed), Starlette's HTTPException
    for an unknown path or method; anything else is a failure of ours, logged here and answered
    without a word about it."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ModelNotFoundError):  # a processor that serves fewer models than this gateway names
        return model_not_found(str(exc))
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, f"the model is overloaded, try again later: {exc}", "service_unavailable",
                        code="overloaded", headers={"Retry-After": str(RETRY_AFTER)})
    if isinstance(exc, HTTPException):
        return APIError(exc.status_code, str(exc.detail),
                        "invalid_request_error" if exc.status_code < 500 else "internal_error",
                        headers=exc.headers)
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), "invalid_request_error")
    if isinstance(exc, EngineDeadError):  # the engine's own words for why it stopped
        return APIError(503, f"the model is not available: {exc}", "service_unavailable", code="service_unavailable",
                        headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER)})
    # Transport errors' details (a gRPC status's: internal addresses) go to the log, not the client.
    if isinstance(exc, ConnectionError):
        logger.warning("the model is not available: %s", exc)
        return APIError(503, "the model is not available", "service_unavailable", code="service_unavailable",
                        headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER)})
    if isinstance(exc, TimeoutError):
        logger.warning("the model did not answer in time: %s", exc)
        return APIError(504, "the model did not answer in time", "timeout", code="timeout")
    logger.error("request failed: %r", exc, exc_info=exc)
    return APIError(500, "internal error", "internal_error", code="internal_error")


# Declared on every route of the OpenAPI schema; "default" also keeps FastAPI from declaring its
# 422, which the gateway never sends (validation errors are 400s).
OPENAPI_ERRORS: dict[int | str, dict] = {
    400: {"model": ErrorResponse, "description": "Invalid request (validation, limits, unknown token ids)"},
    401: {"model": ErrorResponse, "description": "Missing or incorrect API key"},
    404: {"model": ErrorResponse, "description": "Unknown model or path"},
    503: {"model": ErrorResponse, "description": "Overloaded or not serving, with Retry-After"},
    "default": {"model": ErrorResponse, "description": "Any other error, in OpenAI's shape"},
}
