"""Redis at step granularity: the commits of the rounds that end together go as one pipeline.

A verifier step answers every session in it at once, and each session then commits its
round (services/session_store.py) before its tokens are streamed. Made one by one, that
is one Redis round trip and one pass through redis-py's command machinery per session per
round: at 8 streams the commits took about a quarter of the gateway's event-loop time
(py-spy, docs/performance.md). A :class:`CommitBatcher` gathers the commits made in one
wave of the event loop, as the step batcher gathers calls (gateway/step_batch.py), and
sends them as one pipelined write; commits made while it is in flight go in the next.

Nothing about a commit changes: each is the same compare-and-set script on its own
session, prepared with the handle's fields when it was asked for, and each caller gets
its own outcome (a conflict fails that session only; Redis unreachable fails every
commit of the pipeline, as it would have failed each). A chunk is still streamed only
after its commit returned.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.step_batch import gather_wave
from services.session_store import Commit, SessionHandle, SessionStore


@dataclass
class _Queued:
    commit: Commit
    future: asyncio.Future


class CommitBatcher:
    """Commits to ``store`` a pipeline at a time; ``on_pipeline`` is told each one's size."""

    def __init__(self, store: SessionStore, max_turns: int = 16,
                 on_pipeline: Callable[[int], None] = lambda size: None,
                 first: Callable[[], Awaitable[None]] | None = None) -> None:
        """``first``: what a pipeline waits for once its wave is gathered (the engine's: the
        wave's step RPCs going out, gateway/step_batch.py ``steps_sent``)."""
        self.store = store
        self._first = first
        self._on_pipeline = on_pipeline
        self._max_turns = max_turns
        self._queue: list[_Queued] = []
        self._flush: asyncio.Task | None = None  # the pipeline being gathered or in flight

    async def commit(self, h: SessionHandle, appended: list[int], owner: str) -> None:
        """``SessionStore.commit`` of h, sent with the other commits of its wave."""
        queued = _Queued(self.store.prepare_commit(h, appended, owner),
                         asyncio.get_running_loop().create_future())
        self._queue.append(queued)
        if self._flush is None:
            self._start()
        await queued.future

    def _start(self) -> None:
        self._flush = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        batch: list[_Queued] = []
        try:
            await gather_wave(lambda: len(self._queue), self._max_turns)
            if self._first is not None:
                await self._first()
            # A caller that went away still has its commit sent: its handle stays in step
            # with Redis (the version), and a repeated commit is safe anyway.
            batch, self._queue = self._queue, []
            self._on_pipeline(len(batch))
            errors = await self.store.commit_many([q.commit for q in batch])
            for q, error in zip(batch, errors, strict=True):
                if q.future.done():
                    continue
                if error is None:
                    q.future.set_result(None)
                else:
                    q.future.set_exception(error)
        except BaseException as exc:  # cancelled (shutdown) or a bug: no caller waits forever
            if not isinstance(exc, Exception):  # shutting down: nothing more is sent
                batch, self._queue = batch + self._queue, []
                exc = RuntimeError("the gateway's commit pipeline was stopped")
            for q in batch:
                if not q.future.done():
                    q.future.set_exception(exc)
            raise
        finally:
            self._flush = None
            if self._queue:  # the commits made while this pipeline was in flight
                self._start()
