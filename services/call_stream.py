"""Serving a replica's unary calls over one long-lived bidirectional stream.

A gateway makes two or three calls per round to each replica; as unary RPCs each one pays
for a new call (headers, a handler task, trailers), about twice the CPU of a message on an
open stream (docs/performance.md). ``VerifyStream`` and ``DraftStream`` carry the same
requests, each with an id that its response repeats. Every request runs the servicer's own
unary method (validation, telemetry, micro-batching: nothing is duplicated), concurrently
with the others, and its response is written when it is ready, in any order. A call that
fails answers with a ``CallError`` (the status the unary RPC would have ended with) and the
stream goes on.

Once the replica begins its graceful stop (``Drain``), a call arriving on an open stream is
refused with UNAVAILABLE, as the stopping server refuses a new unary call: the gateway goes to
another replica at once instead of being served here until the grace period ends. Calls
already running finish.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from services.errors import RESYNC_KEY, RESYNC_VALUE, InvalidArgument, status_of
from specmesh.v1 import common_pb2


class Drain:
    """Whether this server has begun its graceful stop (``services.server.serve`` starts it)."""

    def __init__(self) -> None:
        self.draining = False

    def start(self) -> None:
        self.draining = True


DRAINING = common_pb2.CallError(
    code=grpc.StatusCode.UNAVAILABLE.value[0],
    message="this replica is shutting down: send the call to another replica")


class CallAborted(grpc.aio.AbortError):
    """One call on a stream ended with a status (raised by its context's ``abort``)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple) -> None:
        super().__init__(details)
        self.code, self.details, self.trailing = code, details, trailing

    def to_pb(self) -> common_pb2.CallError:
        return common_pb2.CallError(code=self.code.value[0], message=self.details,
                                    resync=(RESYNC_KEY, RESYNC_VALUE) in self.trailing)


class CallContext:
    """The part of a ``grpc.aio.ServicerContext`` a unary servicer method uses, for one call
    on a stream: ``abort`` ends that call only."""

    def __init__(self, stream_context) -> None:
        self._stream = stream_context
        self._trailing: tuple = ()

    def set_trailing_metadata(self, metadata) -> None:
        self._trailing = tuple(metadata)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()):
        raise CallAborted(code, details, self._trailing or tuple(trailing_metadata))

    def time_remaining(self) -> float | None:
        return self._stream.time_remaining()

    def invocation_metadata(self):
        return self._stream.invocation_metadata()

    def peer(self) -> str:
        return self._stream.peer()


MAX_BATCH_CALLS = 256  # calls in one VerifyBatch / DraftBatch


def check_batch(requests) -> None:
    """Raises InvalidArgument for a batched RPC with no calls or more than MAX_BATCH_CALLS."""
    if not requests:
        raise InvalidArgument("a batch needs at least one call")
    if len(requests) > MAX_BATCH_CALLS:
        raise InvalidArgument(f"a batch holds at most {MAX_BATCH_CALLS} calls, got "
                              f"{len(requests)}: split it")


def _call_error(exc: BaseException, where: str) -> common_pb2.CallError:
    """The CallError of one call that failed with ``exc``: the status its unary RPC would
    have ended with (services/errors.py ``status_of``)."""
    code, message, trailing = status_of(exc, where)
    return common_pb2.CallError(code=code.value[0], message=message,
                                resync=(RESYNC_KEY, RESYNC_VALUE) in trailing)


def batch_replies(requests, outcomes, to_pb: Callable[[object], object],
                  reply: Callable[[int, object | None, common_pb2.CallError | None], object],
                  where: str) -> list:
    """The stream responses of a batch's calls taken as a whole: per request its outcome's
    result message (``to_pb``), or the CallError its unary RPC would have ended with."""
    return [reply(r.id, None, _call_error(o, where)) if isinstance(o, BaseException)
            else reply(r.id, to_pb(o), None) for r, o in zip(requests, outcomes, strict=True)]


async def _answer(request, context, run: Callable[[object, CallContext], Awaitable[object]],
                  reply: Callable[[int, object | None, common_pb2.CallError | None], object],
                  drain: Drain | None):
    """The reply to one call: its response, or the status its unary RPC would have ended
    with (UNAVAILABLE while ``drain`` is draining)."""
    try:
        if drain is not None and drain.draining:
            return reply(request.id, None, DRAINING)
        return reply(request.id, await run(request, CallContext(context)), None)
    except CallAborted as aborted:
        return reply(request.id, None, aborted.to_pb())
    except Exception as exc:  # noqa: BLE001 - a call's failure must not end the stream
        return reply(request.id, None, common_pb2.CallError(
            code=grpc.StatusCode.INTERNAL.value[0], message=f"internal error: {exc}"))


async def serve_calls(requests: AsyncIterator, context,
                      run: Callable[[object, CallContext], Awaitable[object]],
                      reply: Callable[[int, object | None, common_pb2.CallError | None], object],
                      drain: Drain | None = None) -> None:
    """Runs ``run(request, call_context)`` for each request of the stream, concurrently,
    and writes ``reply(id, response, None)`` or ``reply(id, None, error)`` for each; while
    ``drain`` is draining, answers each new request with UNAVAILABLE instead."""
    write_lock = asyncio.Lock()
    running: set[asyncio.Task] = set()

    async def one(request) -> None:
        out = await _answer(request, context, run, reply, drain)
        async with write_lock:  # one message at a time on the stream
            await context.write(out)

    async for request in requests:
        task = asyncio.ensure_future(one(request))
        running.add(task)
        task.add_done_callback(running.discard)
    if running:
        await asyncio.gather(*running, return_exceptions=True)


async def serve_batch(requests, context,
                      run: Callable[[object, CallContext], Awaitable[object]],
                      reply: Callable[[int, object | None, common_pb2.CallError | None], object],
                      drain: Drain | None = None) -> list:
    """The replies to the calls of one batched RPC (VerifyBatch, DraftBatch), each call
    answered as on a stream. They start in one turn of the event loop, so each reaches the
    model's queue before the model thread takes its next step: they share one pass.
    Raises InvalidArgument for an empty or oversized batch; a second call for one session
    answers ABORTED (the session is busy), as a concurrent unary call would."""
    check_batch(requests)
    return list(await asyncio.gather(*(_answer(r, context, run, reply, drain)
                                       for r in requests)))
