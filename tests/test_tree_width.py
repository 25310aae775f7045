"""The speculation tree (gateway/tree_width.py): as wide as ends with the verify, and
whether to draft one at all, measured."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from gateway.round_plan import RoundPlan
from gateway.session_rounds import SessionRounds
from gateway.tree_width import FLOOR, TreeSwitch, TreeWidth
from services.params import SamplingParams
from services.session_store import SessionHandle
from tests.round_harness import Harness, greedy_chain, tables

PROMPT = [3, 17, 5, 42, 9]


def test_late_trees_narrow_it_to_the_floor_and_trees_in_time_widen_it_back():
    width = TreeWidth(most=16)
    assert width.branches() == 16  # nothing measured: the configured fan-out
    asked = []
    for _ in range(20):  # every tree 5 ms after its verify
        asked.append(width.branches())
        width.observe(asked[-1], 5.0)
    assert asked[:5] == [16, 12, 9, 6, 4]  # x 0.75 of what was asked, per late round
    assert asked[-1] == FLOOR == 4 and min(asked) == FLOOR  # never narrower than the floor
    for _ in range(200):  # then every tree in time: a quarter of a branch per round
        width.observe(width.branches(), 0.0)
    assert width.branches() == 16  # back to the configured fan-out, never past it
    width.observe(16, 0.5)  # at the threshold: not late
    assert width.branches() == 16


def test_it_settles_where_the_tree_ends_with_the_verify():
    """A drafter whose tree of B branches ends 6 + 0.5 B ms after the verify started, a
    verify of 10 ms: up to 9 branches end within the 0.5 ms that counts as in time. The
    width stays near that, and a round that waited (10 branches: 1 ms) is a rare probe."""
    width = TreeWidth(most=16)
    seen = []
    for _ in range(400):
        b = width.branches()
        width.observe(b, max(0.0, 6 + 0.5 * b - 10))
        seen.append(b)
    tail = seen[-200:]
    assert max(tail) <= 10 and min(tail) >= 7, sorted(set(tail))
    assert sum(b > 9 for b in tail) < 0.1 * len(tail)
    assert sum(b >= 8 for b in tail) > 0.5 * len(tail)


def test_a_tree_narrower_than_the_width_says_nothing_about_widening():
    """A tree asked for earlier at a narrower width ended in time: that says nothing about
    the current, wider one."""
    width = TreeWidth(most=16)
    width.observe(16, 5.0)  # -> 12
    width.observe(4, 0.0)
    assert width.branches() == 12


def test_the_floor_never_exceeds_the_configured_fan_out():
    width = TreeWidth(most=2)
    width.observe(2, 50.0)
    assert width.branches() == 2
    with pytest.raises(ValueError, match="most must be >= 1"):
        TreeWidth(most=0)


class _Recorded(TreeWidth):
    """The runner's width with a fixed answer, recording what the rounds report."""

    def __init__(self, most: int, fixed: int) -> None:
        super().__init__(most=most)
        self.fixed, self.reports = fixed, []

    def branches(self) -> int:
        return self.fixed

    def observe(self, branches: int, waited_ms: float) -> None:
        self.reports.append((branches, waited_ms))


def test_the_round_runner_asks_for_the_width_and_reports_each_trees_lateness():
    """Each drafting round's Speculate call asks for the width's branches (at most that many
    come back), and the round reports the tree's lateness after its verify (>= 0); the lead
    round's one-branch guess is not a tree and reports nothing. Output stays the target's."""
    target, draft = tables(vocab=48, seed=3, noise=1.5)
    harness = Harness(target, draft, pipeline=True, fanout=16)
    harness.runner.width = width = _Recorded(16, fixed=5)
    h, rounds = asyncio.run(harness.generate(PROMPT, 40, SamplingParams()))
    assert h.tokens[len(PROMPT):][:40] == greedy_chain(target, PROMPT, 40)
    trees = [r.prefetch for r in rounds if r.prefetch is not None and r.prefetch.width]
    assert trees and all(t.width == 5 and 1 <= len(t.branches) <= 5 for t in trees)
    assert len(width.reports) == len(trees)
    assert all(b == 5 and ms >= 0.0 for b, ms in width.reports)
    lead = rounds[0].prefetch
    assert lead is not None and lead.width == 0  # the lead round's guess: not reported
    assert all(r.trees is None for r in rounds)  # --no-tree-switch: no switch asked



class _Fixed(TreeSwitch):
    """The tree switch with a fixed answer, recording the units the rounds report."""

    def __init__(self, on: bool) -> None:
        super().__init__()
        self.fixed, self.units = on, []

    def mode(self, now: float) -> bool:
        return self.fixed

    def observe(self, started: float, cycle_s: float, tokens: int, cut: bool = False) -> None:
        self.units.append((started, cycle_s, tokens))


def _beside_calls(harness: Harness) -> list[tuple[int, bool]]:
    """Records (drafts, beside) of every Verify call the harness's verifier gets."""
    calls, verify_many = [], harness.verifier.verify_many

    async def recording(batch):
        calls.extend((len(c.draft_ids), c.beside) for c in batch)
        return await verify_many(batch)

    harness.verifier.verify_many = recording
    return calls


@pytest.mark.parametrize("trees", [True, False])
def test_the_tree_switch_decides_whether_a_tree_runs_beside_each_verify(trees):
    """With the switch on, drafting rounds ask the drafter for a tree and tell the verifier
    that one runs beside their verify; off, no round asks for one (each drafts afresh) and
    no verify is told so. Each drafting round is a unit of the switch, from its start to the
    next round's, with its tokens. The output is the target's either way."""
    target, draft = tables(vocab=48, seed=3, noise=1.5)
    harness = Harness(target, draft, pipeline=True, fanout=16)
    harness.runner.config = dataclasses.replace(harness.config, tree_switch=True)
    harness.runner.trees = switch = _Fixed(trees)
    calls = _beside_calls(harness)
    starts = []

    async def run():
        s = SessionRounds(SessionHandle(session_id="s1", version=1, tokens=list(PROMPT)))
        rounds = []
        while len(s.tokens) - len(PROMPT) < 40:
            starts.append(time.perf_counter())
            r = await harness.runner.run(s, RoundPlan(SamplingParams(), 3, "model", 7,
                                                      acceptance=0.8), lambda: None)
            s.advance(r, r.proposed, starts[-1])
            rounds.append(r)
        return s.handle, rounds

    h, rounds = asyncio.run(run())
    assert h.tokens[len(PROMPT):][:40] == greedy_chain(target, PROMPT, 40)
    speculated = [e for e in harness.events if e == ("Speculate", "start")]
    drafted = [beside for n, beside in calls if n]
    assert len(drafted) > 5 and all(beside == trees for beside in drafted)
    assert not any(beside for n, beside in calls if not n)  # (the lead round: no drafts)
    assert bool(speculated) == trees
    asked = [i for i, r in enumerate(rounds) if r.trees is not None]
    assert asked and all(rounds[i].trees == trees for i in asked)
    # a unit per round that asked, measured when the next round starts, with its tokens
    units = [(starts[i], len(rounds[i].proposed)) for i in asked if i + 1 < len(rounds)]
    assert [(u[0], u[2]) for u in switch.units] == units
    assert all(0 < u[1] < 60 for u in switch.units)


def test_a_tree_switch_keeps_no_trees_where_rounds_without_them_run_faster():
    """Rounds of 3 tokens: 30 ms with a tree beside the verify (the verify on one thread),
    20 ms without (on two): after its explorations the switch keeps no trees; where trees
    win (8 against 10 ms) it keeps them."""
    for with_tree, without, kept in ((30.0, 20.0, False), (8.0, 10.0, True)):
        switch, now = TreeSwitch(), 0.0
        for _ in range(2000):
            on = switch.mode(now)
            cycle = (with_tree if on else without) / 1000.0
            switch.observe(now, cycle, 3)
            now += cycle
        assert switch.incumbent is kept


def test_the_gateway_exports_the_tree_switchs_choice():
    """What an operator reads: nothing until the switch has measured, then 1 while trees
    are kept and 0 while they are not."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from services.metrics import GatewayMetrics

    reader = InMemoryMetricReader()
    switch = TreeSwitch()
    GatewayMetrics(MeterProvider(metric_readers=[reader]).get_meter("test"), lambda: 0,
                   trees=lambda: switch)

    def read() -> list[float]:
        return [p.value for rm in reader.get_metrics_data().resource_metrics
                for sm in rm.scope_metrics for m in sm.metrics
                if m.name == "specmesh.spec_cache.trees" for p in m.data.data_points]

    assert read() == []
    now = 0.0
    for _ in range(2000):  # rounds 30 ms with a tree, 20 without
        cycle = (30.0 if switch.mode(now) else 20.0) / 1000.0
        switch.observe(now, cycle, 3)
        now += cycle
    assert read() == [0.0]
    switch.rate, switch.on = {True: 150.0, False: 100.0}, True  # (trees kept, not exploring)
    assert not switch.exploring and read() == [1.0]
