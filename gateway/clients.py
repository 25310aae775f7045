"""Calls to drafters and verifiers: dataclasses in, dataclasses out, errors classified."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from gateway.replicas import Replica
from services.convert import (
    draft_call_to_pb,
    draft_result_from_pb,
    speculate_call_to_pb,
    speculate_result_from_pb,
    verify_call_to_pb,
    verify_result_from_pb,
)
from services.errors import RESYNC_KEY, RESYNC_VALUE, InvalidArgument, ResyncRequired
from services.messages import (
    DraftCall,
    DraftResult,
    SpeculateCall,
    SpeculateResult,
    VerifyCall,
    VerifyResult,
)
from specmesh.v1 import common_pb2


class ReplicaFailed(Exception):
    """The replica could not answer (down, overloaded, timed out, internal error)."""

    def __init__(self, replica: Replica, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{replica.address}: {code.name}: {details}")
        self.replica = replica
        self.code = code


def busy(exc: ReplicaFailed) -> bool:
    """The replica answered ABORTED: the session is busy there with another call."""
    return exc.code == grpc.StatusCode.ABORTED


T = TypeVar("T")
BUSY_WAIT_S = 2.0  # how long a call waits, in all, for a session busy on a replica


async def when_free(call: Callable[[], Awaitable[T]], left: Callable[[], float | None]) -> T:
    """``call()``, made again after a short wait while the replica answers ABORTED: the
    session is busy there with a call of an earlier request. A request cut off by its
    client's deadline or a cancel stops on the gateway at once, but its call on the replica
    ends with the pass it is in (a plain call's passes, up to ``--plain-tokens``), so the
    session's next request can find it busy for a few milliseconds. Waits 5 ms, doubling up
    to 100 ms, at most ``BUSY_WAIT_S`` in all and never past the request's deadline
    (``left()``: seconds left, None without one); then the ABORTED stands. The replica is
    not at fault either way."""
    wait, waited = 0.005, 0.0
    while True:
        try:
            return await call()
        except ReplicaFailed as exc:
            remaining = left()
            if not busy(exc) or waited + wait > BUSY_WAIT_S or (
                    remaining is not None and remaining < wait):
                raise
        await asyncio.sleep(wait)
        waited += wait
        wait = min(2 * wait, 0.1)


async def _call(replica: Replica, method: str, request, timeout: float):
    replica.inflight += 1
    try:
        return await replica.call(method, request, timeout)
    except grpc.aio.AioRpcError as err:
        code = err.code()
        trailing = dict(err.trailing_metadata() or ())
        if code == grpc.StatusCode.FAILED_PRECONDITION and trailing.get(RESYNC_KEY) == RESYNC_VALUE:
            raise ResyncRequired(err.details()) from err
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise InvalidArgument(f"{replica.address} rejected the request: {err.details()}") from err
        raise ReplicaFailed(replica, code, err.details() or "") from err
    finally:
        replica.inflight -= 1


async def draft(replica: Replica, call: DraftCall, timeout: float) -> DraftResult:
    return draft_result_from_pb(await _call(replica, "Draft", draft_call_to_pb(call), timeout))


async def speculate(replica: Replica, call: SpeculateCall, timeout: float) -> SpeculateResult:
    return speculate_result_from_pb(
        await _call(replica, "Speculate", speculate_call_to_pb(call), timeout))


async def verify(replica: Replica, call: VerifyCall, timeout: float) -> VerifyResult:
    return verify_result_from_pb(await _call(replica, "Verify", verify_call_to_pb(call), timeout))


async def model_info(replica: Replica, timeout: float) -> common_pb2.ModelInfo:
    return await _call(replica, "GetModelInfo", common_pb2.ModelInfoRequest(), timeout)


async def release(replica: Replica, session_id: str, timeout: float) -> bool:
    response = await _call(replica, "Release", common_pb2.ReleaseRequest(session_id=session_id),
                           timeout)
    return response.released
