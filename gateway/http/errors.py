"""Errors in OpenAI's JSON shape, ``{"error": {"message", "type", "param", "code"}}``, with
the HTTP status of each domain error (services/errors.py)."""

from __future__ import annotations

import math
import re

from fastapi.responses import JSONResponse

from services.errors import (
    Busy,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    Overloaded,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)

# (status, type, code) per domain error; InvalidArgument is also a ValueError: check it first.
_STATUS = (
    (InvalidArgument, 400, "invalid_request_error", None),
    (Unauthenticated, 401, "authentication_error", "invalid_api_key"),
    (PermissionDenied, 403, "permission_error", "permission_denied"),
    (NotFound, 404, "not_found_error", "not_found"),
    (Busy, 409, "conflict_error", "session_busy"),
    (Overloaded, 429, "rate_limit_error", "rate_limit_exceeded"),
    (Unimplemented, 501, "not_implemented_error", None),
    (Unavailable, 503, "service_unavailable_error", "service_unavailable"),
    (DeadlineExceeded, 504, "timeout_error", "timeout"),
)
_RETRY_IN = re.compile(r"retry in ([0-9.]+) s")


class ApiError(Exception):
    """An error answered as ``status`` with OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def from_exception(exc: BaseException) -> ApiError:
    """The HTTP error of a domain error (any other exception: 500)."""
    if isinstance(exc, ApiError):
        return exc
    for cls, status, type_, code in _STATUS:
        if isinstance(exc, cls):
            retry = None
            if status in (429, 503):  # tell the client when to come back
                found = _RETRY_IN.search(str(exc))
                retry = float(found.group(1)) if found else 1.0
            return ApiError(status, str(exc), type_, code=code, retry_after_s=retry)
    if isinstance(exc, ValueError):
        return ApiError(400, str(exc))
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")
