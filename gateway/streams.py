"""The gateway's end of a replica's call stream (VerifyStream / DraftStream).

One stream per replica carries every Draft, Speculate and Verify call the gateway makes
to it (services/call_stream.py is the replica's end). A call writes its request with a
fresh id and waits for the response with that id; one reader task hands responses to
their callers. A call's own failure arrives as a ``CallError`` and is raised as the
``grpc.aio.AioRpcError`` the unary RPC would have raised (resync trailer included), so
gateway/clients.py classifies both alike. When the stream itself breaks (the replica
died), every pending call fails with its status and the next call opens a new stream.
A replica without the streaming RPC (an older version) answers UNIMPLEMENTED: the stream
is marked unsupported and the caller uses unary calls from then on.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import grpc
from grpc.aio import AioRpcError, Metadata

from services.errors import RESYNC_KEY, RESYNC_VALUE
from specmesh.v1 import common_pb2, drafter_pb2, verifier_pb2


class StreamUnsupported(Exception):
    """The replica has no call stream: use unary calls."""


def rpc_error(code: grpc.StatusCode, details: str, resync: bool = False) -> AioRpcError:
    """The error a unary RPC ending with ``code`` raises (with the resync trailer when asked)."""
    trailing = Metadata((RESYNC_KEY, RESYNC_VALUE)) if resync else Metadata()
    return AioRpcError(code, Metadata(), trailing, details)


_CODES = {code.value[0]: code for code in grpc.StatusCode}
_NO_OUTCOME = common_pb2.CallError(code=grpc.StatusCode.INTERNAL.value[0],
                                   message="the replica answered a stream call with no result")


def outcome_error(message) -> tuple[object | None, AioRpcError | None]:
    """(the call's response, None) or (None, the error its unary RPC would have raised) of
    a stream response; both kinds of response carry them in a oneof named ``outcome``."""
    which = message.WhichOneof("outcome")
    error = _NO_OUTCOME if which is None else message.error if which == "error" else None
    if error is not None:
        return None, rpc_error(_CODES.get(error.code, grpc.StatusCode.UNKNOWN), error.message,
                               error.resync)
    return getattr(message, which), None


class CallStream:
    """``open()`` starts the stream RPC; ``wrap(id, request)`` builds a stream request."""

    def __init__(self, open_stream: Callable[[], grpc.aio.StreamStreamCall],
                 wrap: Callable[[int, object], object]) -> None:
        self._open, self._wrap = open_stream, wrap
        self._ids = itertools.count(1)
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._write_lock = asyncio.Lock()
        self.supported = True

    async def call(self, request, timeout: float):
        """The response to ``request``; raises AioRpcError as a unary call would."""
        if not self.supported:
            raise StreamUnsupported()
        call_id = next(self._ids)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending[call_id] = future
        deadline = loop.time() + timeout
        try:
            # One write at a time: gRPC fails a write issued while another is in flight.
            async with self._write_lock:
                if self._call is None:
                    self._call = self._open()
                    self._reader = asyncio.ensure_future(self._read(self._call))
                stream = self._call
                try:
                    await asyncio.wait_for(stream.write(self._wrap(call_id, request)),
                                           max(0.0, deadline - loop.time()))
                except TimeoutError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the stream is broken: drop it
                    await self._broken(stream, exc)
            return await asyncio.wait_for(future, max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                         f"no answer within {timeout:.1f} s") from None
        finally:
            self._pending.pop(call_id, None)

    async def _broken(self, stream: grpc.aio.StreamStreamCall, exc: Exception) -> None:
        """A write failed: the stream is unusable. Raises what the unary call would have:
        StreamUnsupported when the replica has no such RPC, else UNAVAILABLE (the next call
        opens a new stream; the reader fails the other calls still pending on this one)."""
        if self._call is stream:
            self._call = None
        if stream.done() and await stream.code() == grpc.StatusCode.UNIMPLEMENTED:
            self.supported = False
            raise StreamUnsupported() from exc
        stream.cancel()
        raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"the call stream broke: {exc}") from exc

    async def _read(self, stream: grpc.aio.StreamStreamCall) -> None:
        failure: Exception = rpc_error(grpc.StatusCode.UNAVAILABLE, "the call stream ended")
        try:
            async for message in stream:
                response, error = outcome_error(message)
                future = self._pending.get(message.id)
                if future is None or future.done():
                    continue  # its caller gave up (timeout, cancelled)
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(response)
        except AioRpcError as exc:  # the stream itself ended: the replica is unreachable
            failure = rpc_error(grpc.StatusCode.UNAVAILABLE,
                             f"the call stream broke ({exc.code().name}: {exc.details()})")
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.supported = False
                failure = StreamUnsupported()
        except asyncio.CancelledError:
            failure = rpc_error(grpc.StatusCode.CANCELLED, "the call stream was closed")
        finally:
            if self._call is stream:
                self._call = None
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(failure)

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if self._reader is not None:
            self._reader.cancel()


def wrap_verify(call_id: int, request) -> verifier_pb2.VerifyStreamRequest:
    return verifier_pb2.VerifyStreamRequest(id=call_id, call=request)


def wrap_draft(call_id: int, request) -> drafter_pb2.DraftStreamRequest:
    if isinstance(request, drafter_pb2.SpeculateRequest):
        return drafter_pb2.DraftStreamRequest(id=call_id, speculate=request)
    return drafter_pb2.DraftStreamRequest(id=call_id, draft=request)


def replica_stream(kind: str, stub) -> CallStream:
    """The call stream of a verifier's or a drafter's stub."""
    if kind == "verifier":
        return CallStream(stub.VerifyStream, wrap_verify)
    return CallStream(stub.DraftStream, wrap_draft)
