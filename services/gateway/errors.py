"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and the one mapping
from what the processor client raises to an HTTP status."""

from __future__ import annotations

import logging

from services.gateway.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error the gateway answers as it is (unknown model, a request it refuses)."""

    def __init__(self, status: int, message: str, type: str, param: str | None = None,
                 code: int | str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model", "model_not_found")


def error_of(exc: BaseException) -> tuple[int, ErrorResponse]:
    """The status and body for `exc`. The processor client raises ValueError for invalid input,
    ConnectionError when a service behind the gateway is unreachable or not serving, TimeoutError
    for a deadline that passed; anything else is a failure of ours."""
    if isinstance(exc, APIError):
        status, info = exc.status, exc.info
    elif isinstance(exc, ValueError):
        status, info = 400, ErrorInfo(message=str(exc), type="invalid_request_error")
    elif isinstance(exc, ConnectionError):
        status, info = 503, ErrorInfo(message=f"the model is not available: {exc}", type="service_unavailable",
                                      code="service_unavailable")
    elif isinstance(exc, TimeoutError):
        status, info = 504, ErrorInfo(message=f"the model did not answer in time: {exc}", type="timeout",
                                      code="timeout")
    else:
        logger.error("request failed: %r", exc, exc_info=exc)
        status, info = 500, ErrorInfo(message=f"internal error: {exc}", type="internal_error",
                                      code="internal_error")
    return status, ErrorResponse(error=info)
