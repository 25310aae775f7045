"""Step batching: a gateway's Draft or Verify calls to one replica go out as one RPC per step.

Every session runs its own rounds, and the gateway accounts for them one at a time on its
event loop, so their calls reach a replica one by one. A replica that starts a forward pass
for whatever has arrived (continuous batching) then runs many small passes, out of phase:
at 16 streams the verifier's model thread was busy all the time yet averaged ~4 sessions a
pass (docs/performance.md), and a pass over 4 sessions costs nearly what one over 16 does
(the weights are read once per pass either way).

A :class:`StepBatcher` keeps at most one step in flight per replica and call kind. Calls
made while a step is in flight wait, and when it returns they all go together as the next
step: one ``VerifyBatch`` or ``DraftBatch`` RPC, whose calls the replica runs in one pass
(or one run of k passes). A step gathers its wave first (see the class), so sessions fall
into cohorts that take turns, one verifying while the other drafts, and each pass holds
every session that is ready: at 16 streams the verifier's passes went from 4.8 to 6.9
sessions and the mesh's CPU per token from 4.8 to 2.2 ms (docs/performance.md). A step of
one call (a lone stream) goes over the usual path, one stream message, as before.

Each call keeps its own outcome: a resync or a bad request fails that call only; a step
that fails as a whole (the replica is down) fails each of its calls with the RPC's status,
as their own unary calls would have failed.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc
from grpc.aio import AioRpcError
from opentelemetry import trace

from gateway.streams import outcome_error, rpc_error

# (requests) -> their stream responses (VerifyStreamResponse / DraftStreamResponse), each
# carrying the index of its request as its id, in any order.
SendBatch = Callable[[Sequence[object], float], Awaitable[Sequence[object]]]
SendOne = Callable[[object, float], Awaitable[object]]


@dataclass
class _Waiting:
    request: object
    future: asyncio.Future
    deadline: float  # the loop's clock
    context: contextvars.Context  # the caller's: a call sent alone runs in it (its span's child)
    session: str = ""  # its session, and whether it verifies no drafts (StepBatcher's describe)
    plain: bool = False


def _link(w: _Waiting) -> trace.Link | None:
    span = w.context.run(trace.get_current_span)
    return trace.Link(span.get_span_context()) if span.get_span_context().is_valid else None


async def steps_sent(batchers: Callable[[], Iterable[StepBatcher]], max_turns: int = 16) -> None:
    """Yields to the event loop until no step of ``batchers`` is being gathered (at most
    ``max_turns`` turns), then once more, so that the steps' RPCs start before the caller
    goes on. Work off the sessions' critical path (a wave's Redis commits,
    gateway/commits.py) runs after it: packed and written first, it held the wave's Verify
    step back by ~0.8 ms of a ~24 ms step at 16 streams (docs/performance.md)."""
    for _ in range(max_turns):
        if not any(b.gathering for b in batchers()):
            break
        await asyncio.sleep(0)
    await asyncio.sleep(0)


async def gather_wave(size: Callable[[], int], max_turns: int) -> None:
    """Yields to the event loop until one turn of it added nothing to a queue (``size``),
    at most ``max_turns`` turns: the calls of one wave (the sessions an answer woke, each
    making its next call as the loop accounts for it) then go together."""
    seen = -1
    for _ in range(max_turns):
        if size() == seen:
            return
        seen = size()
        await asyncio.sleep(0)


class StepBatcher:
    """One replica's calls of one kind (``name``: "Verify" or "Draft"), a step at a time.
    ``send_one`` makes a call alone; ``send_batch`` makes one batched RPC. A replica that
    answers the batched RPC with UNIMPLEMENTED (an older version) gets each call alone from
    then on.

    A step takes the calls of one wave: after a step returns, its sessions' next calls are
    made one after another as the event loop accounts for each session, with no I/O in
    between. So a step starts only once one turn of the loop has added no call (at most
    ``max_turns`` turns, microseconds each): the wave goes together instead of its first
    call alone and the rest one step later.

    Calls that wait while a step is in flight form a second cohort, and cohorts that take
    turns are what a drafting mesh wants (one verifies while the other drafts). Calls without
    drafts gain nothing from taking turns: the verifier would run two passes that cost nearly
    what one over both cohorts does. So when the step that just returned held only such
    calls (``describe`` says which: a request's session and whether it is one), and the calls
    waiting are such calls too, the next step also waits for the returned step's sessions to
    call again (at most ``merge_s``): the cohorts merge. A session whose request ended never
    calls again, and the engine says so (``forget``), so that no step waits for it. Only
    while ``merging()`` says so: a plain epoch that only explores (drafting is the mode the
    gateway keeps, gateway/load_switch.py) must not leave the drafting epochs one cohort."""

    def __init__(self, name: str, send_one: SendOne, send_batch: SendBatch,
                 tracer: trace.Tracer | None = None, max_turns: int = 16,
                 describe: Callable[[object], tuple[str, bool]] = lambda request: ("", False),
                 merging: Callable[[], bool] = lambda: True, merge_s: float = 0.01,
                 fit: Callable[[list], None] = lambda requests: None,
                 express: Callable[[object], bool] = lambda request: False,
                 lone: Callable[[], bool] = lambda: False) -> None:
        """``fit``: adjusts a step's requests before they go together (a Verify step that
        feeds a prompt or verifies drafts asks every call for one token: gateway/replicas.py
        ``fit_verify_step``). ``express``: whether a call goes on its own path at once while
        a step is gathered or in flight, instead of in the next step (``call``). ``lone``:
        whether the gateway runs a single request, whose call then goes out at once."""
        self.name = name
        self._fit = fit
        self._express = express
        self._send_one, self._send_batch = send_one, send_batch
        self._tracer = tracer or trace.get_tracer("specmesh")
        self._max_turns = max_turns
        self._describe, self._merging, self._merge_s = describe, merging, merge_s
        self._lone = lone
        self._expected: set[str] = set()  # sessions of the last step, which had no drafts
        self._gone: set[str] = set()  # sessions forgotten while a step was in flight
        self._arrived = asyncio.Event()  # set by every call
        self._queue: list[_Waiting] = []
        self._step: asyncio.Task | None = None  # the step being gathered or in flight
        self._sent = False  # whether that step's calls went out
        self.batched = True  # False once the replica said it has no batched RPC
        self.steps = 0  # steps sent
        self.calls = 0  # calls sent in them
        self.largest = 0  # most calls in one step
        self.expressed = 0  # calls sent on their own path beside a step (``express``)
        self.direct = 0  # calls of a lone request, sent at once (``lone``)

    async def call(self, request, timeout: float):
        """The response to ``request``; raises AioRpcError as a unary call would.

        An ``express`` call (a Verify call that feeds a prompt) made while a step is gathered
        or in flight goes at once on its own path, in its caller's context: the replica's
        continuous batching takes it into the pass after the one it runs, while the step's
        calls go on. In the next step it would wait for the step out (up to --plain-tokens
        passes) and then cut every call of its own step to one token (``fit``): at 8 streams
        with requests arriving while others decode, about one plain round in five was cut
        that way (docs/performance.md).

        A call made while the gateway runs a single request and no step is out goes at once
        too: no other session's call can join it, and gathering a wave only let the loop's
        other work (the last round's commit and chunk) run first. At one stream on a 2-core
        CPU a call waited ~0.45 ms between being made and being sent, of a ~6 ms one-token
        round (docs/performance.md)."""
        if self._step is not None and self._express(request):
            self.expressed += 1
            return await self._send_one(request, timeout)
        if self._step is None and not self._queue and self._lone():
            self.direct += 1
            return await self._send_one(request, timeout)
        loop = asyncio.get_running_loop()
        waiting = _Waiting(request, loop.create_future(), loop.time() + timeout,
                           contextvars.copy_context(), *self._describe(request))
        self._queue.append(waiting)
        self._expected.discard(waiting.session)
        self._arrived.set()
        if self._step is None:
            self._start()
        try:
            return await asyncio.wait_for(waiting.future, timeout)
        except TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"no answer within {timeout:.1f} s") from None
        finally:
            if not waiting.future.done():  # timed out or cancelled before its step ended
                waiting.future.cancel()
            if waiting in self._queue:
                self._queue.remove(waiting)

    @property
    def gathering(self) -> bool:
        """Whether a step is being gathered: calls wait that have not gone out yet."""
        return self._step is not None and not self._sent

    def forget(self, session: str) -> None:
        """``session``'s request has ended: it calls no more, so no step waits for it to call
        again. (Waiting for it held the next step ``merge_s``, 10 ms, each time a request
        ended: every new request's first round, at any load.)"""
        if self._step is not None:  # its answer may be in the step that is out
            self._gone.add(session)
        if session in self._expected:
            self._expected.discard(session)
            self._arrived.set()  # _merge checks again

    def _start(self) -> None:
        # The step is nobody's child: it serves every caller, whose spans it links.
        self._sent = False
        self._step = asyncio.get_running_loop().create_task(self._run(),
                                                            context=contextvars.Context())

    async def _run(self) -> None:
        try:
            await gather_wave(lambda: len(self._queue), self._max_turns)
            if self._expected and all(w.plain for w in self._queue) and self._merging():
                await self._merge()
            batch = [w for w in self._queue if not w.future.done()]
            self._queue.clear()
            self._expected, self._gone = set(), set()
            self._sent = True
            if batch:
                self.steps += 1
                self.calls += len(batch)
                self.largest = max(self.largest, len(batch))
                timeout = max(0.001, max(w.deadline for w in batch)
                              - asyncio.get_running_loop().time())
                if len(batch) == 1 or not self.batched:
                    await asyncio.gather(*(self._alone(w, timeout) for w in batch))
                else:
                    self._fit([w.request for w in batch])
                    await self._together(batch, timeout)
                if all(w.plain for w in batch):  # (less those that called again already,
                    # and those whose requests ended as the step's answers came in)
                    self._expected = ({w.session for w in batch}
                                      - {w.session for w in self._queue} - self._gone)
        finally:
            self._step = None
            if self._queue:  # the calls made while this step was in flight
                self._start()

    async def _merge(self) -> None:
        """Waits (at most ``merge_s``) until the sessions of the step that returned have
        called again, then for the rest of their wave."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self._merge_s
        while self._expected and (left := end - loop.time()) > 0:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                break
        await gather_wave(lambda: len(self._queue), self._max_turns)

    async def _alone(self, w: _Waiting, timeout: float) -> None:
        """Sends one call on its own path, in its caller's context (its trace)."""
        try:
            result = await asyncio.get_running_loop().create_task(
                self._send_one(w.request, timeout), context=w.context)
        except Exception as exc:  # noqa: BLE001 - handed to its caller
            if not w.future.done():
                w.future.set_exception(exc)
            return
        if not w.future.done():
            w.future.set_result(result)

    async def _together(self, batch: list[_Waiting], timeout: float) -> None:
        links = [link for link in map(_link, batch) if link is not None]
        try:
            with self._tracer.start_as_current_span(
                    f"specmesh.step.{self.name}", links=links,
                    attributes={"specmesh.calls": len(batch)}):
                responses = await self._send_batch([w.request for w in batch], timeout)
        except AioRpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.batched = False  # an older replica: each call alone, now and from now on
                await asyncio.gather(*(self._alone(w, timeout) for w in batch))
                return
            for w in batch:
                if not w.future.done():
                    w.future.set_exception(err)
            return
        answered = set()
        for message in responses:
            if not 0 <= message.id < len(batch) or message.id in answered:
                continue
            answered.add(message.id)
            future = batch[message.id].future
            if future.done():  # its caller gave up
                continue
            response, error = outcome_error(message)
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(response)
        for i, w in enumerate(batch):
            if i not in answered and not w.future.done():
                w.future.set_exception(rpc_error(
                    grpc.StatusCode.INTERNAL, "the replica's batched answer left this call out"))
