"""The speculation tree's width (gateway/tree_width.py): as wide as ends with the verify."""

from __future__ import annotations

import asyncio

import pytest

from gateway.tree_width import FLOOR, TreeWidth
from services.params import SamplingParams
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
