"""Requests whose bytes cannot be parsed get INVALID_ARGUMENT, on every service.

By default grpc answers a request message that its deserializer rejects (protobuf's
``DecodeError``) with ``UNKNOWN: Unexpected <class '...DecodeError'>``, which reads like a
server bug. ``DecodeGuard``, a server interceptor, wraps each unary-request method's
deserializer: bytes that do not parse become an ``Undecodable`` value, and the method's
behaviour answers it with INVALID_ARGUMENT naming the expected message before any servicer
code runs.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class Undecodable:
    message_type: str
    error: str


def _safe(deserializer):
    message_type = getattr(getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None),
                           "full_name", "request")

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or any parser's own error
            return Undecodable(message_type, str(exc) or type(exc).__name__)

    return deserialize


async def _reject(request: Undecodable, context) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"the request is not a valid {request.message_type} message "
                        f"({request.error})")


def _guard(behavior):
    """``behavior`` that answers an Undecodable request with INVALID_ARGUMENT; None when its
    kind (a plain function, run in a thread) cannot be wrapped here."""
    if inspect.isasyncgenfunction(behavior):
        async def guarded_stream(request, context):
            if isinstance(request, Undecodable):
                await _reject(request, context)
            async for item in behavior(request, context):
                yield item
        return guarded_stream
    if inspect.iscoroutinefunction(behavior):
        async def guarded(request, context):
            if isinstance(request, Undecodable):
                await _reject(request, context)
            return await behavior(request, context)
        return guarded
    return None


class DecodeGuard(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        field = "unary_stream" if handler.response_streaming else "unary_unary"
        guarded = _guard(getattr(handler, field))
        if guarded is None:
            return handler
        return handler._replace(request_deserializer=_safe(handler.request_deserializer),
                                **{field: guarded})
