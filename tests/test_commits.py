"""The gateway's commit batcher (gateway/commits.py) against a real redis-server: the
commits of one wave go as one pipeline, later ones in the next, and each caller gets its
own commit's outcome."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from gateway.commits import CommitBatcher
from gateway.step_batch import StepBatcher, steps_sent
from services.errors import Busy, Unavailable
from services.session_store import SessionHandle, SessionStore
from specmesh.v1 import verifier_pb2
from tests.conftest import start_redis


class GatedStore(SessionStore):
    """The real store, whose pipelines wait for ``gate`` (so a test decides when one that
    is in flight returns) and are recorded (how many commits each carried)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.gate = asyncio.Event()
        self.gate.set()
        self.sizes: list[int] = []

    async def commit_many(self, commits):
        self.sizes.append(len(commits))
        await self.gate.wait()
        return await super().commit_many(commits)


def run(url: str, body):
    async def main():
        client = aioredis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        store = GatedStore(client, 60, 5.0, prefix=f"commits:{uuid.uuid4().hex}:")
        try:
            return await body(store, CommitBatcher(store))
        finally:
            await store.close()

    return asyncio.run(main())


async def sessions(store: SessionStore, n: int) -> list[SessionHandle]:
    handles = []
    for _ in range(n):
        h = SessionHandle(session_id=uuid.uuid4().hex, version=1, tokens=[1, 2])
        await store.create(h)
        await store.acquire(h.session_id, "me")
        handles.append(h)
    return handles


async def advance(batcher: CommitBatcher, h: SessionHandle, tokens: list[int],
                  after_turns: int = 0) -> None:
    """Commits h's next tokens after ``after_turns`` turns of the event loop (the sessions
    that one verifier answer wakes reach their commits one after another)."""
    for _ in range(after_turns):
        await asyncio.sleep(0)
    h.tokens += tokens
    await batcher.commit(h, tokens, "me")


def test_commits_of_one_wave_go_as_one_pipeline(redis_url):
    async def body(store, batcher):
        handles = await sessions(store, 8)
        await asyncio.gather(*(advance(batcher, h, [10 + i], after_turns=i)
                               for i, h in enumerate(handles)))
        loaded = [await store.load(h.session_id) for h in handles]
        return store.sizes, handles, loaded

    sizes, handles, loaded = run(redis_url, body)
    assert sizes == [8]
    for i, (h, stored) in enumerate(zip(handles, loaded, strict=True)):
        assert h.version == 2 and stored.version == 2
        assert stored.tokens == [1, 2, 10 + i]


def test_commits_made_while_a_pipeline_is_in_flight_go_together_in_the_next(redis_url):
    async def body(store, batcher):
        handles = await sessions(store, 7)
        store.gate.clear()
        first = [asyncio.create_task(advance(batcher, h, [5])) for h in handles[:4]]
        while not store.sizes:  # the first pipeline is gathered and waits at the gate
            await asyncio.sleep(0)
        later = [asyncio.create_task(advance(batcher, h, [6])) for h in handles[4:]]
        for _ in range(20):
            await asyncio.sleep(0)
        in_flight = list(store.sizes)
        store.gate.set()
        await asyncio.gather(*first, *later)
        return in_flight, store.sizes, [await store.load(h.session_id) for h in handles]

    in_flight, sizes, loaded = run(redis_url, body)
    assert in_flight == [4], "a second pipeline must not start while one is in flight"
    assert sizes == [4, 3]
    assert [s.tokens[-1] for s in loaded] == [5, 5, 5, 5, 6, 6, 6]


def test_each_caller_gets_its_own_outcome(redis_url):
    async def body(store, batcher):
        good, stale = await sessions(store, 2)
        ahead = await store.load(stale.session_id)
        ahead.tokens += [9]
        await store.commit(ahead, [9], "me")  # ``stale`` is now one version behind
        results = await asyncio.gather(advance(batcher, good, [3]), advance(batcher, stale, [4]),
                                       return_exceptions=True)
        return store.sizes, results, good, stale

    sizes, results, good, stale = run(redis_url, body)
    assert sizes == [1, 2]  # the direct commit above, then the wave of two
    assert results[0] is None and good.version == 2
    assert isinstance(results[1], Busy) and stale.version == 1


def test_a_caller_that_went_away_still_has_its_commit_applied(redis_url):
    """A request cancelled while its commit is in flight: the commit is applied anyway
    (repeating it would be safe too) and its handle's version follows Redis's."""

    async def body(store, batcher):
        gone, stays = await sessions(store, 2)
        store.gate.clear()
        cancelled = asyncio.create_task(advance(batcher, gone, [7]))
        kept = asyncio.create_task(advance(batcher, stays, [8]))
        while not store.sizes:
            await asyncio.sleep(0)
        cancelled.cancel()
        store.gate.set()
        await kept
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        while batcher._flush is not None:
            await asyncio.sleep(0)
        return gone, await store.load(gone.session_id)

    gone, stored = run(redis_url, body)
    assert stored.tokens == [1, 2, 7] and stored.version == 2 and gone.version == 2


def test_redis_down_fails_every_commit_of_the_pipeline(tmp_path):
    proc, url = start_redis(tmp_path)

    async def body(store, batcher):
        handles = await sessions(store, 3)
        proc.terminate()
        proc.wait(10)
        return await asyncio.gather(*(advance(batcher, h, [4]) for h in handles),
                                    return_exceptions=True)

    try:
        results = run(url, body)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)
    assert all(isinstance(r, Unavailable) for r in results)
    assert len({id(r) for r in results}) == 3, "each caller raises its own error"


@pytest.mark.parametrize("steps_first", [True, False], ids=["steps-first", "no-hook"])
def test_a_waves_pipeline_goes_after_its_step_rpcs(redis_url, steps_first):
    """The engine's order (gateway/engine.py): each session that an answer wakes saves its
    round (a commit) and makes its next Verify call from a task of its own, a turn later.
    The commits are off the critical path, the step is on every session's: with
    ``first=steps_sent``, the wave's pipeline starts only once its step's RPC went out.
    Without it (the control), the pipeline is packed and written first."""
    order: list[str] = []

    class Recorded(GatedStore):
        async def commit_many(self, commits):
            order.append("commit")
            return await super().commit_many(commits)

    async def send_batch(requests, timeout):
        order.append("step")
        return [verifier_pb2.VerifyStreamResponse(id=i, result=verifier_pb2.VerifyResponse())
                for i in range(len(requests))]

    async def main():
        client = aioredis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        store = Recorded(client, 60, 5.0, prefix=f"commits:{uuid.uuid4().hex}:")
        step = StepBatcher("Verify", lambda request, timeout: send_batch([request], timeout),
                           send_batch)
        batcher = CommitBatcher(store, first=(lambda: steps_sent(lambda: [step]))
                                if steps_first else None)
        try:
            handles = await sessions(store, 4)

            async def session(h, i):
                saving = asyncio.create_task(advance(batcher, h, [10 + i]))
                await asyncio.sleep(0)  # its round runs as a task of its own
                await step.call(i, 5.0)
                await saving

            await asyncio.gather(*(session(h, i) for i, h in enumerate(handles)))
            return [await store.load(h.session_id) for h in handles]
        finally:
            await store.close()

    loaded = asyncio.run(main())
    assert [s.tokens[-1] for s in loaded] == [10, 11, 12, 13]
    assert order == (["step", "commit"] if steps_first else ["commit", "step"])
