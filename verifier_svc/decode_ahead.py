"""Decoding ahead: a verifier goes on with a session's next plain round while the gateway
handles the one it just answered.

A round without drafts (target-only, or while drafts do not pay) is a call that decodes up
to ``max_tokens`` tokens. Between two such rounds of a session the model waits for the
answer to travel, for the gateway to account for the round and stream it, and for the next
call to arrive: a few milliseconds a round, which on a GPU, where a pass of a small target
takes well under one, left the verifier idle for a third or more of the time
(docs/performance.md). The next round is known once the answer is: the same session from
the last token returned, the same sampling settings, and a seed the gateway can name in
advance. So a call may ask (``ahead`` > 0, ``ahead_seed``) for that next round to start as
soon as it is answered: the verifier checks the session out again and queues that call's
own job (verifier_svc/engine.py), which joins the running batch like any other.

The session's next call takes the job over when it asks for exactly that round (the same
cache delta, settings, seed and logprobs, at most as many tokens): it is answered from the
job, done or still running, with the tokens it asked for; a job that went further is
trimmed to them. Any other call for the session (drafts to verify, another prefix, a
Release) stops the job at its next pass and waits for it, and then runs on the cache
cropped to its own base, as it would have. A job nobody takes within ``ttl_s`` is stopped
and its cache put back at rest. What a call returns is what it would return without this:
the job is the one the call would have run, from the same seed.
"""

from __future__ import annotations

import asyncio
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from services.messages import ReplicaStats, VerifyCall

TTL_S = 10.0  # a job no call took over within this is stopped (its gateway went away)


@dataclass
class Ahead:
    """A running (or finished) job of the session's next round, and its checkout."""

    call: VerifyCall  # the call it runs ahead of
    checkout: AbstractContextManager  # entered: the session's cache is busy until exited
    job: Any  # the call's _VerifyJob (verifier_svc/engine.py)
    future: asyncio.Future  # ModelRunner.submit's: (result, compute ms, batch)
    timer: asyncio.TimerHandle | None = None

    def serves(self, call: VerifyCall) -> bool:
        """Whether ``call`` asks for this round: the same delta (session, base, hash and the
        token to feed), settings, seed and local drafts (sampling: they draw differently)
        and logprobs, and at most its tokens."""
        a = self.call
        return (not call.draft_ids and call.cache == a.cache and call.params == a.params
                and (call.params.greedy or (call.seed == a.seed and call.local == a.local))
                and call.logprobs == a.logprobs and 1 <= call.max_tokens <= a.max_tokens)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


class DecodeAhead:
    """A verifier's decode-ahead jobs, one per session at most."""

    def __init__(self, stats: ReplicaStats, ttl_s: float = TTL_S) -> None:
        self.stats = stats
        self.ttl_s = ttl_s
        self._jobs: dict[str, Ahead] = {}

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._jobs

    def add(self, ahead: Ahead) -> None:
        """Holds a job just submitted (its checkout entered) until a call takes it."""
        sid = ahead.call.cache.session_id
        ahead.timer = asyncio.get_running_loop().call_later(self.ttl_s, self._expire, sid,
                                                            ahead)
        self._jobs[sid] = ahead
        self.stats.ahead_started += 1
        ahead.future.add_done_callback(_retrieve)  # a failure no call takes is not an error

    def take(self, call: VerifyCall) -> tuple[AbstractContextManager, Any,
                                              asyncio.Future] | None:
        """The checkout, job and future that answer ``call``, when its session's job serves
        it (ModelEngine.run_many's ``adopt``); else None."""
        ahead = self._jobs.get(call.cache.session_id)
        if ahead is None or not ahead.serves(call):
            return None
        del self._jobs[call.cache.session_id]
        ahead.timer.cancel()
        ahead.job.limit_to(call.max_tokens)
        if ahead.future.done():  # (else the runner trims it as it settles: _VerifyJob.result)
            ahead.job.trim()
        self.stats.ahead_taken += 1
        return ahead.checkout, ahead.job, ahead.future

    async def settle(self, calls: list[VerifyCall]) -> None:
        """Stops, and waits for, the jobs of the calls' sessions that those calls do not
        take: each call then checks its session out as usual."""
        for call in calls:
            ahead = self._jobs.get(call.cache.session_id)
            if ahead is not None and not ahead.serves(call):
                await self.drop(call.cache.session_id)

    async def drop(self, session_id: str) -> None:
        """Stops the session's job and waits until its cache is back at rest (or dropped,
        if the job failed). Cancelling the wait leaves the job to end on its own."""
        ahead = self._jobs.pop(session_id, None)
        if ahead is not None:
            await asyncio.wait([self._stop(ahead)])

    def _expire(self, session_id: str, ahead: Ahead) -> None:
        if self._jobs.get(session_id) is ahead:
            del self._jobs[session_id]
            self._stop(ahead)

    @staticmethod
    def _stop(ahead: Ahead) -> asyncio.Future:
        """Ends the job at its next pass and exits its checkout once it is done; returns its
        future. The checkout is exited by a done callback, so that a cancelled waiter never
        leaves the session busy."""
        ahead.timer.cancel()
        ahead.job.stop()

        def exit_checkout(future: asyncio.Future) -> None:
            error = asyncio.CancelledError() if future.cancelled() else future.exception()
            if error is None:
                ahead.checkout.__exit__(None, None, None)
            else:  # the job failed: its cache may be half-written, so it is dropped
                ahead.checkout.__exit__(type(error), error, error.__traceback__)

        ahead.future.add_done_callback(exit_checkout)
        return ahead.future
