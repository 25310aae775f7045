"""The gateway's step batcher (gateway/step_batch.py), in process: which calls go together,
how each call's own outcome reaches it. The replica's side is a stand-in that records the
steps it is sent and answers with real stream-response messages; the batched RPCs against
real replica processes are in tests/test_call_streams.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc.aio import AioRpcError

from gateway.step_batch import StepBatcher
from gateway.streams import rpc_error
from services.errors import RESYNC_KEY, RESYNC_VALUE
from specmesh.v1 import common_pb2, verifier_pb2


class _Replica:
    """Answers request n (an int) with num_accepted = n, after ``delay`` seconds; records
    each step as ("one", [n]) or ("batch", [n, ...])."""

    def __init__(self, delay: float = 0.02, fail=None, resync=frozenset(), drop=frozenset()):
        self.delay, self.fail, self.resync, self.drop = delay, fail, resync, drop
        self.steps: list[tuple[str, list[int]]] = []

    async def one(self, request: int, timeout: float):
        self.steps.append(("one", [request]))
        await asyncio.sleep(self.delay)
        return verifier_pb2.VerifyResponse(num_accepted=request)

    async def batch(self, requests, timeout: float):
        self.steps.append(("batch", list(requests)))
        await asyncio.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        out = []
        for i, n in reversed(list(enumerate(requests))):  # in any order
            if n in self.drop:
                continue
            if n in self.resync:
                out.append(verifier_pb2.VerifyStreamResponse(id=i, error=common_pb2.CallError(
                    code=grpc.StatusCode.FAILED_PRECONDITION.value[0], message="resync",
                    resync=True)))
            else:
                out.append(verifier_pb2.VerifyStreamResponse(
                    id=i, result=verifier_pb2.VerifyResponse(num_accepted=n)))
        return out


def _batcher(replica: _Replica) -> StepBatcher:
    return StepBatcher("Verify", replica.one, replica.batch)


async def _wave(b: StepBatcher, ns, timeout: float = 5.0):
    """Calls made one after another in one turn of the loop, as sessions accounted for in
    turn make them; their results or errors."""
    return await asyncio.gather(*(b.call(n, timeout) for n in ns), return_exceptions=True)


def test_a_lone_call_goes_alone_on_the_usual_path():
    async def main():
        replica = _Replica()
        b = _batcher(replica)
        r = await b.call(7, 5.0)
        assert r.num_accepted == 7
        assert replica.steps == [("one", [7])]

    asyncio.run(main())


def test_a_lone_requests_call_goes_out_before_the_loop_turns_and_joins_a_step_out():
    """While the gateway runs one request (``lone``), its call is sent in the same turn of
    the loop as it is made, before other ready work (here a callback queued just before
    it): no other session's call could join a step. A call made while a step is out (the
    request count fell to one as it went) still waits for that step and goes in the next."""
    async def main():
        replica = _Replica(delay=0.05)
        lone = [True]
        b = StepBatcher("Verify", replica.one, replica.batch, lone=lambda: lone[0])
        order = []
        asyncio.get_running_loop().call_soon(lambda: order.append(len(replica.steps)))
        r = await b.call(7, 5.0)
        assert r.num_accepted == 7 and replica.steps == [("one", [7])]
        assert order == [1]  # sent before the callback ran
        assert b.direct == 1 and b.steps == 0
        lone[0] = False
        step = [asyncio.ensure_future(b.call(n, 5.0)) for n in (0, 1)]
        await asyncio.sleep(0.01)  # that step is out
        lone[0] = True
        later = asyncio.ensure_future(b.call(2, 5.0))
        await asyncio.sleep(0.01)
        assert replica.steps == [("one", [7]), ("batch", [0, 1])]  # 2 waits for the step
        assert [x.num_accepted for x in await asyncio.gather(*step, later)] == [0, 1, 2]
        assert replica.steps[-1] == ("one", [2]) and b.direct == 1

    asyncio.run(main())


def test_a_wave_goes_as_one_step_and_each_call_gets_its_own_answer():
    async def main():
        replica = _Replica()
        b = _batcher(replica)
        results = await _wave(b, range(6))
        assert [r.num_accepted for r in results] == list(range(6))
        assert replica.steps == [("batch", [0, 1, 2, 3, 4, 5])]

    asyncio.run(main())


def test_an_express_call_goes_beside_the_step_in_flight_not_in_the_next():
    """A Verify call that feeds a prompt (``express``; here the requests of 100 and more)
    made while a step is in flight goes at once on its own path, answered while that step
    is still out, and the calls made beside it still go together as the next step: in it
    the prompt would wait for the step out and cut its calls to one token each."""
    async def main():
        replica = _Replica(delay=0.05)
        b = StepBatcher("Verify", replica.one, replica.batch, express=lambda n: n >= 100)
        step = [asyncio.ensure_future(b.call(n, 5.0)) for n in (0, 1)]
        await asyncio.sleep(0.01)  # that step is in flight
        later = [asyncio.ensure_future(b.call(n, 5.0)) for n in (2, 3)]
        prompt = asyncio.ensure_future(b.call(100, 5.0))
        await asyncio.sleep(0.01)
        assert not any(f.done() for f in step)  # the first step is still out ...
        assert replica.steps == [("batch", [0, 1]), ("one", [100])]  # ... the prompt went
        assert (await prompt).num_accepted == 100
        results = await asyncio.gather(*step, *later)
        assert [r.num_accepted for r in results] == [0, 1, 2, 3]
        assert replica.steps == [("batch", [0, 1]), ("one", [100]), ("batch", [2, 3])]
        assert b.expressed == 1
        alone = await b.call(101, 5.0)  # no step out: an express call starts one as usual
        assert alone.num_accepted == 101 and replica.steps[-1] == ("one", [101])
        assert b.expressed == 1

    asyncio.run(main())


def test_calls_made_while_a_step_is_in_flight_go_together_as_the_next_step():
    async def main():
        replica = _Replica(delay=0.05)
        b = _batcher(replica)
        first = asyncio.ensure_future(b.call(0, 5.0))
        await asyncio.sleep(0.01)  # the first call's step is in flight
        later = [asyncio.ensure_future(b.call(n, 5.0)) for n in (1, 2)]
        await asyncio.sleep(0.01)
        later.append(asyncio.ensure_future(b.call(3, 5.0)))  # another turn, same step
        results = await asyncio.gather(first, *later)
        assert [r.num_accepted for r in results] == [0, 1, 2, 3]
        assert replica.steps == [("one", [0]), ("batch", [1, 2, 3])]
        assert (b.steps, b.calls, b.largest) == (2, 4, 3)

    asyncio.run(main())


def test_a_resync_fails_its_own_call_only():
    async def main():
        b = _batcher(_Replica(resync={2}))
        results = await _wave(b, range(4))
        err = results[2]
        assert isinstance(err, AioRpcError)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert dict(err.trailing_metadata())[RESYNC_KEY] == RESYNC_VALUE
        assert [r.num_accepted for i, r in enumerate(results) if i != 2] == [0, 1, 3]

    asyncio.run(main())


def test_a_failed_step_fails_each_of_its_calls_with_its_status():
    async def main():
        b = _batcher(_Replica(fail=rpc_error(grpc.StatusCode.UNAVAILABLE, "replica down")))
        results = await _wave(b, range(3))
        assert [(type(e), e.code()) for e in results] == [
            (AioRpcError, grpc.StatusCode.UNAVAILABLE)] * 3

    asyncio.run(main())


def test_a_replica_without_the_batched_rpc_gets_each_call_alone_from_then_on():
    async def main():
        replica = _Replica(fail=rpc_error(grpc.StatusCode.UNIMPLEMENTED, "no such method"))
        b = _batcher(replica)
        results = await _wave(b, range(3))
        assert [r.num_accepted for r in results] == [0, 1, 2]
        assert not b.batched
        await _wave(b, (5, 6))
        assert replica.steps == [("batch", [0, 1, 2]), ("one", [0]), ("one", [1]),
                                 ("one", [2]), ("one", [5]), ("one", [6])]

    asyncio.run(main())


def test_a_call_the_replica_left_out_fails_as_internal():
    async def main():
        b = _batcher(_Replica(drop={1}))
        results = await _wave(b, range(3))
        assert results[1].code() == grpc.StatusCode.INTERNAL
        assert "left this call out" in results[1].details()
        assert [results[0].num_accepted, results[2].num_accepted] == [0, 2]

    asyncio.run(main())


def test_a_call_whose_deadline_passes_while_it_waits_is_not_sent():
    async def main():
        replica = _Replica(delay=0.2)
        b = _batcher(replica)
        first = asyncio.ensure_future(b.call(0, 5.0))
        await asyncio.sleep(0.01)
        with pytest.raises(AioRpcError) as late:
            await b.call(1, 0.05)  # waits behind the step in flight, past its deadline
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert (await first).num_accepted == 0
        await asyncio.sleep(0.01)
        assert replica.steps == [("one", [0])]  # the expired call never went out

    asyncio.run(main())


def test_a_cancelled_caller_leaves_the_others_their_answers():
    async def main():
        replica = _Replica(delay=0.05)
        b = _batcher(replica)
        calls = [asyncio.ensure_future(b.call(n, 5.0)) for n in range(3)]
        await asyncio.sleep(0.01)  # the step is in flight
        calls[1].cancel()
        assert (await calls[0]).num_accepted == 0 and (await calls[2]).num_accepted == 2
        with pytest.raises(asyncio.CancelledError):
            await calls[1]
        r = await b.call(9, 5.0)  # the batcher goes on
        assert r.num_accepted == 9

    asyncio.run(main())


def _cohorts(offset: int) -> list[list[int]]:
    """Sessions 0-3 run 3 rounds, sessions 4-5 join while the first step is in flight; each
    session calls again 2 ms after its answer. Call n = 10 * round + session + ``offset``
    (100: a call with drafts). The steps the replica saw, as sorted call lists."""

    async def main():
        replica = _Replica(delay=0.03)
        b = StepBatcher("Verify", replica.one, replica.batch,
                        describe=lambda n: (f"s{n % 10}", n < 100))

        async def session(i: int, rounds: int) -> None:
            for r in range(rounds):
                await b.call(10 * r + i + offset, 5.0)
                await asyncio.sleep(0.002)  # the gateway's accounting of the round

        async def late(i: int) -> None:
            await asyncio.sleep(0.01)  # while the first step is in flight
            await session(i, 3)

        await asyncio.gather(*(session(i, 3) for i in range(4)), late(4), late(5))
        return [sorted(n - offset for n in calls) for _, calls in replica.steps]

    return asyncio.run(main())


def test_cohorts_without_drafts_merge_and_cohorts_with_drafts_take_turns():
    """Two cohorts of calls without drafts would take turns, two passes for what one pass over
    both costs about as much as: the waiting one waits for the other's sessions to call
    again, and from then on every step holds every session. Cohorts with drafts keep taking
    turns (one verifies while the other drafts)."""
    assert _cohorts(0) == [[0, 1, 2, 3], [4, 5, 10, 11, 12, 13], [14, 15, 20, 21, 22, 23],
                           [24, 25]]
    assert _cohorts(100) == [[0, 1, 2, 3], [4, 5], [10, 11, 12, 13], [14, 15],
                             [20, 21, 22, 23], [24, 25]]


def test_cohorts_without_drafts_keep_taking_turns_while_drafting_is_the_kept_mode():
    """merging() False (a load switch keeps drafting and only explores without drafts): the
    cohorts stay as they are, ready for the drafting epochs."""

    async def main():
        replica = _Replica(delay=0.03)
        b = StepBatcher("Verify", replica.one, replica.batch,
                        describe=lambda n: (f"s{n % 10}", True), merging=lambda: False)

        async def session(i: int, start: float) -> None:
            await asyncio.sleep(start)
            for r in range(2):
                await b.call(10 * r + i, 5.0)
                await asyncio.sleep(0.002)

        await asyncio.gather(session(0, 0.0), session(1, 0.0), session(2, 0.01))
        return [sorted(calls) for _, calls in replica.steps]

    assert asyncio.run(main()) == [[0, 1], [2], [10, 11], [12]]


def test_a_step_does_not_wait_for_a_session_whose_request_ended():
    """A session whose last call was in a step without drafts never calls again once its
    request ends: the next step (a new request's first call) goes at once, not after the
    merge wait (merge_s) for the ended session; a session that did not end is still waited
    for. The engine says which ended (``forget``), before or after the step's end is
    accounted."""

    async def main(forget_early: bool, forget: bool) -> tuple[float, list]:
        replica = _Replica(delay=0.02)
        b = StepBatcher("Verify", replica.one, replica.batch, merge_s=0.5,
                        describe=lambda n: (f"s{n % 10}", True))
        loop = asyncio.get_running_loop()
        first = asyncio.ensure_future(b.call(1, 5.0))  # session s1's last call
        if forget and forget_early:
            await asyncio.sleep(0.01)  # its step is in flight
            b.forget("s1")
        await first
        if forget and not forget_early:
            b.forget("s1")
        start = loop.time()
        await b.call(2, 5.0)  # a new session, s2: its first call
        return loop.time() - start, [calls for _, calls in replica.steps]

    for early in (False, True):
        took, steps = asyncio.run(main(early, forget=True))
        assert steps == [[1], [2]] and took < 0.2, (early, took)  # 0.02 s: the replica's delay
    took, steps = asyncio.run(main(False, forget=False))
    assert steps == [[1], [2]] and took >= 0.5  # s1 still running: waited for, as designed
