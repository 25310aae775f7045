"""Domain errors and their gRPC status codes.

Plain modules raise these; servicers translate them with ``grpc_errors`` so
each failure reaches the client as a precise status with a message that says
what to fix.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Callable

import grpc

log = logging.getLogger(__name__)

RESYNC_KEY = "specmesh-resync"
RESYNC_VALUE = "required"


class SpecMeshError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(SpecMeshError, ValueError):
    """``field``: the request field at fault, in the neutral names of gateway/requests.py
    (the HTTP API answers it as the error's ``param``, in its own name)."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str = "", field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class NotFound(SpecMeshError):
    code = grpc.StatusCode.NOT_FOUND


class Busy(SpecMeshError):
    """Another request holds the session."""

    code = grpc.StatusCode.ABORTED


class Overloaded(SpecMeshError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(SpecMeshError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(SpecMeshError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unimplemented(SpecMeshError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Unavailable(SpecMeshError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(SpecMeshError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class StartupError(RuntimeError):
    """A service cannot start as configured (a port it must listen on is taken, a replica
    or Redis it needs does not answer); the message says what to fix. The CLI prints it as
    one line and exits 2."""


class ResyncRequired(SpecMeshError):
    """A replica's session cache does not hold what the caller assumed."""

    code = grpc.StatusCode.FAILED_PRECONDITION


def _metadata(err: SpecMeshError) -> tuple[tuple[str, str], ...]:
    return ((RESYNC_KEY, RESYNC_VALUE),) if isinstance(err, ResyncRequired) else ()


def status_of(exc: BaseException, where: str) -> tuple[grpc.StatusCode, str, tuple]:
    """The status a failure of ``where`` (a servicer method) answers: (code, message,
    trailing metadata). SpecMeshError keeps its code, ValueError is INVALID_ARGUMENT, a
    cancellation CANCELLED; anything else is a bug, logged, and INTERNAL."""
    if isinstance(exc, SpecMeshError):
        return exc.code, str(exc), _metadata(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), ()
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED, "the call was cancelled", ()
    log.error("internal error in %s", where, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}", ()


def grpc_errors(method: Callable) -> Callable:
    """Maps SpecMeshError (and ValueError) raised by a servicer method to a gRPC status."""

    async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
        code, message, trailing = status_of(exc, method.__qualname__)
        if trailing:
            context.set_trailing_metadata(trailing)
        await context.abort(code, message)

    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                await _abort(context, exc)

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            await _abort(context, exc)

    return unary_wrapper
