"""The round loop's decisions, in process and in milliseconds (tests/round_harness.py):
losslessness, speculation-cache branch selection and hit accounting, the replicas' cursors,
reproducible seeded sampling, and what a replica that lost its cache costs."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from gateway.replicas import Replica, ReplicaPool
from gateway.rounds import ADMIT_WAIT_S, fanout_share
from services.batching import Row, StepJob
from services.errors import Busy
from services.model_runner import ModelRunner
from services.params import SamplingParams
from tests.round_harness import Harness, greedy_chain, tables

PROMPT = [3, 17, 5, 42, 9]
GREEDY = SamplingParams()


def _run(harness: Harness, n: int, params=GREEDY, **kw):
    return asyncio.run(harness.generate(PROMPT, n, params, **kw))


@pytest.mark.parametrize("pipeline,fanout", [(False, 4), (True, 1), (True, 4), (True, 16)])
def test_greedy_output_is_the_targets_own(pipeline, fanout):
    """With and without the speculation cache, at any fan-out: the committed tokens are the
    target's greedy chain, computed from its tables alone."""
    target, draft = tables(vocab=48, seed=1, noise=1.5)
    harness = Harness(target, draft, pipeline=pipeline, fanout=fanout)
    h, rounds = _run(harness, 60)
    assert h.tokens[len(PROMPT):][:60] == greedy_chain(target, PROMPT, 60)
    accepted = sum(r.num_accepted for r in rounds)
    assert 0 < accepted < 3 * len(rounds)  # the drafter is right sometimes, not always


def test_a_prepared_branch_is_used_exactly_when_it_was_committed():
    """Each round: "used" iff the committed (accepted drafts + the verifier's token) was one
    of the branches prepared during the previous verify; then the round made no draft call
    and its drafts are that branch's. Otherwise "dropped" (something prepared) or "none".
    The first round is the lead round (no drafts verified, one draft call beside)."""
    target, draft = tables(vocab=48, seed=2, noise=1.5)
    harness = Harness(target, draft, pipeline=True, fanout=6)
    stub = harness.stub("drafter")
    seen = {"used": 0, "dropped": 0, "none": 0, "": 0}
    draft_calls = [0]

    def check(before, committed_before, r, h):
        calls = stub.calls.get("Draft", 0)
        new_draft_calls, draft_calls[0] = calls - draft_calls[0], calls
        first = not sum(seen.values())
        seen[r.pipeline] += 1
        if first:
            assert r.pipeline == "" and r.drafted == () and new_draft_calls == 1
            return
        if before is None:
            assert r.pipeline == "none" and new_draft_calls == 1
            return
        key = tuple(committed_before[before.base:])
        if key in before.branches:
            assert r.pipeline == "used" and new_draft_calls == 0
            assert r.drafted == before.branches[key].token_ids
        else:
            assert r.pipeline == "dropped" and new_draft_calls == 1

    _run(harness, 80, on_round=check)
    assert seen["used"] > 0 and seen["dropped"] > 0  # both paths ran
    assert seen[""] == 1  # the lead round only
    assert stub.calls["Speculate"] == sum(seen.values()) - 1  # one per round with drafts


def test_a_lead_round_is_never_timed_as_a_round_without_drafts():
    """A request whose first rounds ran without drafts and then drafts leads with the
    verifier alone while the drafter catches up on the whole session: its verifier is warm,
    but the round is no plain round of one token. Its result is not warm, so the gateway's
    cost model times neither it nor its cycle (gateway/draft_length.py): timed as a plain
    round it made plain rounds look three times dearer and lone requests draft where
    drafting lost."""
    from gateway.rounds import RoundPlan
    from gateway.session_rounds import SessionRounds
    from services.session_store import SessionHandle

    target, draft = tables(vocab=48, seed=3, noise=1.5)
    harness = Harness(target, draft, pipeline=True)

    async def go():
        s = SessionRounds(SessionHandle(session_id="s1", version=1, tokens=list(PROMPT)))
        results = []
        for k in (0, 0, 3, 3):
            r = await harness.runner.run(s, RoundPlan(GREEDY, k, "model", 7, acceptance=0.8,
                                                      tokens=4), lambda: None)
            s.advance(r, r.proposed, 0.0)
            results.append(r)
        return s, results

    s, (first, plain, lead, drafted) = asyncio.run(go())
    assert plain.warm and not plain.drafted and len(plain.proposed) == 4
    assert lead.drafted == () and lead.prefetch is not None  # the lead round: drafter beside
    assert harness.drafter.caches.fresh_prefills == 1 and not lead.warm
    assert drafted.drafted  # the round after it drafts on the warm drafter
    assert s.tokens[len(PROMPT):] == greedy_chain(target, PROMPT, len(s.tokens) - len(PROMPT))


@pytest.mark.parametrize("seed", [2, 3, 4, 5])
def test_a_new_session_leads_with_the_verifier_alone(seed):
    """The first round of a session no drafter holds verifies no drafts, so its token waits
    only for the verifier's prefill, while the drafter computes the prompt and k drafts
    beside it (its call starts before the verify ends). Greedy, its drafts after the
    first are round two's draft when the verifier's token equals the first draft, with no
    draft call; otherwise round two drafts afresh on the warm drafter. The output is the
    target's greedy chain either way."""
    target, draft = tables(vocab=48, seed=seed, noise=1.5)
    harness = Harness(target, draft, pipeline=False)
    drafter = harness.stub("drafter")
    draft_calls = []  # Draft calls made by the end of each round

    def check(before, committed_before, r, h):
        draft_calls.append(drafter.calls.get("Draft", 0))

    h, rounds = _run(harness, 30, on_round=check)
    assert h.tokens[len(PROMPT):][:30] == greedy_chain(target, PROMPT, 30)
    lead = rounds[0]
    assert lead.drafted == () and lead.num_accepted == 0
    events = harness.events
    assert events.index(("Draft", "start")) < events.index(("Verify", "end"))
    (branch, prepared), = lead.prefetch.branches.items()
    assert len(branch) == 1 and len(prepared.token_ids) == 2  # k = 3: the guess, then 2
    second, calls_after_two = rounds[1], draft_calls[1]
    if lead.extra_token == branch[0]:
        assert second.pipeline == "used" and second.drafted == prepared.token_ids
        assert calls_after_two == 1  # the lead round's call only
    else:
        assert second.pipeline == "dropped" and calls_after_two == 2
    assert harness.drafter.caches.fresh_prefills == 1  # the lead call's: never again


def test_cursors_match_what_each_replica_holds_so_no_round_resyncs():
    """After every round the handle's cursors name a prefix each replica's cache really
    holds (the committed tokens), and no call ever needed a resync or a fresh prefill
    beyond the first: a cursor that ran ahead would force resyncs, one that lagged would
    make the replica recompute."""
    target, draft = tables(vocab=48, seed=3, noise=1.5)
    harness = Harness(target, draft, pipeline=True, fanout=4)

    def check(before, committed_before, r, h):
        for engine, held in ((harness.verifier, h.verifier.length), (harness.drafter, h.drafter.length)):
            entry = engine.caches._entries["s1"]
            assert 0 < held <= len(h.tokens)
            assert entry.tokens[:held] == h.tokens[:held]
            assert entry.kv.get_seq_length() == len(entry.tokens)
        # the verifier keeps exactly the accepted prefix; the last token is fed next round
        assert h.verifier.length == len(h.tokens) - 1

    _run(harness, 60, on_round=check)
    for engine in (harness.verifier, harness.drafter):
        assert engine.caches.resyncs_requested == 0
        assert engine.caches.fresh_prefills == 1


def test_seeded_sampling_draws_the_same_with_or_without_the_speculation_cache():
    """A branch draws with the seed a fresh draft of that round would use, from the same q:
    the same seed gives the same sampled text whether the drafts came from the cache, at
    any fan-out, or from draft calls."""
    target, draft = tables(vocab=48, seed=4, noise=1.0)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    outputs = set()
    for pipeline, fanout in ((False, 4), (True, 2), (True, 12)):
        h, rounds = _run(Harness(target, draft, pipeline=pipeline, fanout=fanout), 50,
                         params, seed=11)
        outputs.add(tuple(h.tokens[len(PROMPT):][:50]))
        if pipeline:
            assert any(r.pipeline == "used" for r in rounds)
    assert len(outputs) == 1
    other, _ = _run(Harness(target, draft, pipeline=True, fanout=4), 50, params, seed=12)
    assert tuple(other.tokens[len(PROMPT):][:50]) not in outputs  # the seed matters


def test_a_drafter_that_lost_the_session_is_resynced_and_output_is_unchanged():
    """Evicting the session from the drafter mid-stream costs one resync, not a wrong
    token: the cursor check (base hash) catches it."""
    target, draft = tables(vocab=48, seed=5, noise=1.5)
    harness = Harness(target, draft, pipeline=True, fanout=4)
    evicted = []

    def evict(before, committed_before, r, h):
        if len(evicted) < 1 and len(h.tokens) > len(PROMPT) + 20:
            evicted.append(harness.drafter.caches.release("s1"))

    h, rounds = _run(harness, 60, on_round=evict)
    assert evicted == [True]
    assert h.tokens[len(PROMPT):][:60] == greedy_chain(target, PROMPT, 60)
    assert harness.drafter.caches.resyncs_requested >= 1
    # a resync, not a replica failure: every round after the lead round has its drafts
    assert rounds[0].drafted == () and all(r.drafted for r in rounds[1:])


def test_a_busy_drafter_or_a_loaded_gateway_gets_no_branches():
    """The whole fan-out while the drafter serves no other call, none while it serves any: a
    tree runs alone and would hold back other sessions' critical-path draft calls."""
    assert [fanout_share(16, busy) for busy in range(4)] == [16, 0, 0, 0]
    # under load (more requests than --spec-max-requests) none, idle or not
    assert [fanout_share(16, 0, n, 1) for n in (1, 2, 16)] == [16, 0, 0]
    assert [fanout_share(16, 0, n, 4) for n in (1, 4, 5)] == [16, 16, 0]
    assert fanout_share(1, 0) == 1 and fanout_share(1, 1) == 0


class _OneStep(StepJob):
    """A batched job of one pass over token 1 on a fresh cache; ``fail`` raises instead."""

    def __init__(self, lm, fail: BaseException | None = None) -> None:
        self.lm, self.fail, self.logits = lm, fail, None

    @property
    def done(self) -> bool:
        return self.logits is not None

    def next_row(self) -> Row:
        if self.fail is not None:
            raise self.fail
        return Row(tokens=[1], kv=self.lm.new_cache(), start=0, keep=1)

    def take(self, logits) -> None:
        self.logits = logits

    def result(self):
        return self.logits


def test_a_job_raising_stop_iteration_fails_only_its_own_call():
    """asyncio futures refuse a StopIteration (e.g. ``next()`` on an empty iterator in a
    model's code). A solo job's used to hang its call and every job behind it; a batched
    job's raised in the runner and failed the jobs batched with it. Now it is that call's
    RuntimeError, and the other calls are answered."""
    from services.model_runner import SoloJob
    from tests.round_harness import _meta

    target, _ = tables(8, 0, 0.0)
    runner = ModelRunner(target, _meta(target, "t"), torch.device("cpu"), max_queue=8, max_batch=32)

    async def body():
        with pytest.raises(RuntimeError, match="StopIteration"):
            await asyncio.wait_for(runner.submit(SoloJob(lambda *_: next(iter(())), 1)), 10)
        solo, _, _ = await asyncio.wait_for(runner.submit(SoloJob(lambda *_: 7, 1)), 10)
        bad, good = await asyncio.wait_for(asyncio.gather(
            runner.submit(_OneStep(target, StopIteration())), runner.submit(_OneStep(target)),
            return_exceptions=True), 10)
        return solo, bad, good

    solo, bad, good = asyncio.run(body())
    assert solo == 7
    assert isinstance(bad, RuntimeError) and "StopIteration" in str(bad)
    logits, _, batch = good
    assert batch == 2 and torch.equal(logits[0], target.a[1] + target.b[0])


def _busy_for(caches, session_id: str, seconds: float | None) -> None:
    """Holds ``session_id`` busy in a replica's caches, as a call of an earlier request that
    still runs there would; released after ``seconds`` (None: kept)."""
    caches._busy.add(session_id)
    if seconds is not None:
        asyncio.get_running_loop().call_later(seconds, caches._busy.discard, session_id)


def test_a_session_still_busy_on_the_verifier_waits_and_the_replica_stays_up():
    """A request cut off by its client's deadline leaves its call running on the verifier
    for a pass or so; the session's next request used to get ABORTED there, mark the one
    verifier down and fail with UNAVAILABLE. It now waits for the call to end, and
    output is unchanged."""
    target, draft = tables(vocab=48, seed=3, noise=1.0)
    harness = Harness(target, draft, pipeline=False)

    async def go():
        def hold(before, committed_before, r, h):
            if len(h.tokens) - len(PROMPT) in range(1, 5) and not held:
                held.append(True)
                _busy_for(harness.verifier.caches, "s1", 0.03)
        held = []
        h, rounds = await harness.generate(PROMPT, 30, GREEDY, on_round=hold)
        return h, rounds, held

    h, rounds, held = asyncio.run(go())
    assert held == [True]
    assert h.tokens[len(PROMPT):][:30] == greedy_chain(target, PROMPT, 30)
    verifier = harness.pools["verifier"].replicas["verifier"]
    assert verifier.up  # never marked down
    assert harness.stub("verifier").calls["Verify"] > len(rounds)  # one a round, + ABORTED


def test_a_session_that_stays_busy_is_aborted_not_unavailable(monkeypatch):
    """Past the wait (``BUSY_WAIT_S``) the request gets Busy (ABORTED: retry), and neither
    replica is marked down; a drafter where the session stays busy drafts nothing for the
    round instead of failing it."""
    monkeypatch.setattr("gateway.clients.BUSY_WAIT_S", 0.05)
    target, draft = tables(vocab=48, seed=3, noise=1.0)

    async def go(kind: str):
        harness = Harness(target, draft, pipeline=False)
        _busy_for(getattr(harness, kind).caches, "s1", None)
        try:
            return harness, await harness.generate(PROMPT, 8, GREEDY)
        except Busy as exc:
            return harness, exc

    harness, outcome = asyncio.run(go("verifier"))
    assert isinstance(outcome, Busy) and "still busy on verifier" in str(outcome)
    assert harness.stub("verifier").calls["Verify"] >= 3  # waited, called again
    assert harness.pools["verifier"].replicas["verifier"].up
    harness, (h, rounds) = asyncio.run(go("drafter"))
    assert h.tokens[len(PROMPT):][:8] == greedy_chain(target, PROMPT, 8)
    assert all(r.drafted == () for r in rounds)  # no drafts while the drafter is busy
    assert harness.pools["drafter"].replicas["drafter"].up


def test_a_round_waits_for_a_replica_being_admitted_when_none_is():
    """A rollout that replaced every verifier at once: the new one takes no traffic until its
    model check answers (gateway/server.py). A round waits for it instead of failing with
    "no verifier replica could serve the request", which tests/test_gateway_discovery.py
    met on a loaded machine when its only verifier was swapped."""
    target, draft = tables(vocab=48, seed=4, noise=1.5)
    harness = Harness(target, draft, pipeline=False)
    replica = harness.pools["verifier"].replicas["verifier"]
    replica.admitted = False

    async def go():
        async def admit():
            await asyncio.sleep(0.3)
            replica.admitted = True

        admitting = asyncio.ensure_future(admit())
        start = time.monotonic()
        h, _ = await harness.generate(PROMPT, 5, GREEDY)
        await admitting
        return h, time.monotonic() - start

    h, took = asyncio.run(go())
    assert h.tokens[len(PROMPT):][:5] == greedy_chain(target, PROMPT, 5)
    assert took >= 0.3


def test_the_wait_for_admission_is_bounded_and_only_when_none_is_admitted():
    pool = ReplicaPool("verifier", (), retry_s=1.0, channel_options=[])

    def took(wait_s: float) -> float:
        start = time.monotonic()
        asyncio.run(pool.admitted(wait_s, poll_s=0.01))
        return time.monotonic() - start

    assert took(5.0) < 0.1  # no replica at all: nothing to wait for
    pool.replicas["a"] = Replica("a", None, None, admitted=False)
    assert 0.2 <= took(0.2) < 1.0  # none admitted, ever: gives up after wait_s
    pool.replicas["b"] = Replica("b", None, None, admitted=True)
    assert took(5.0) < 0.1  # one admitted: no wait


def test_rounds_go_on_without_drafts_while_no_drafter_is_admitted():
    """Without an admitted drafter a round runs without drafts at once (as when none is
    reachable) rather than waiting for one: only the verifier is waited for."""
    target, draft = tables(vocab=48, seed=5, noise=1.5)
    harness = Harness(target, draft, pipeline=False)
    harness.pools["drafter"].replicas["drafter"].admitted = False
    start = time.monotonic()
    h, rounds = _run(harness, 6)
    assert time.monotonic() - start < ADMIT_WAIT_S
    assert h.tokens[len(PROMPT):][:6] == greedy_chain(target, PROMPT, 6)
    assert all(not r.drafted for r in rounds)
