"""The gate on a verifier's own drafts (verifier_svc/draft_gate.py): pure logic, step times
and acceptance counts given as a verifier's steps would report them."""

from __future__ import annotations

import pytest

from services.acceptance import AcceptanceCounts
from verifier_svc.draft_gate import DraftGate


def _timed(gate: DraftGate, level: int, plain_s: float, draft_s: float) -> None:
    gate.observe_step(level, False, plain_s)
    gate.observe_step(level, True, draft_s)


def test_every_session_drafts_until_both_kinds_of_step_are_timed_and_drafts_counted():
    gate = DraftGate()
    assert gate.allows("a", 1, 3)
    gate.observe_step(1, False, 0.003)
    assert gate.allows("a", 1, 3)
    gate.observe_step(1, True, 0.009)
    assert gate.allows("a", 1, 3), "no drafts counted at the level yet"
    gate.observe_drafts("b", 1, 3, 0)
    assert not gate.allows("a", 1, 3)
    assert gate.allows("a", 2, 3), "another level: nothing timed there"


@pytest.mark.parametrize("alpha, step_ratio, drafts", [
    (0.8, 1.5, True),    # E(3) = 2.95 tokens for 1.5 steps' time
    (0.27, 1.5, False),  # E(3) = 1.37 (the demo drafts behind 385-820-token prompts)
    (0.27, 1.3, True),   # ... where a drafting step costs less than that
    (0.5, 1.9, False),   # E(3) = 1.875
])
def test_a_session_drafts_while_its_expected_tokens_pay_for_a_drafting_step(
        alpha, step_ratio, drafts):
    """E(α, k) = (1 − α^(k+1)) / (1 − α) tokens of a drafting step against the step times'
    ratio; α here is the session's own over many steps (the prior then weighs little)."""
    gate = DraftGate(prior_steps=0.001)
    _timed(gate, 1, 0.004, 0.004 * step_ratio)
    gate._levels[1] = AcceptanceCounts(successes=alpha, failures=1 - alpha)
    gate._sessions["s"] = AcceptanceCounts(successes=100 * alpha, failures=100 * (1 - alpha))
    assert gate.allows("s", 1, 3) is drafts


def test_a_new_session_starts_from_its_levels_acceptance_and_moves_with_its_own():
    """A session with no drafts of its own takes the level's α; its own steps then move it
    within eight: one whose drafts are all rejected is held back although the level's
    sessions are accepted at 0.8, and the others still draft."""
    gate = DraftGate()
    _timed(gate, 1, 0.003, 0.0045)
    for _ in range(30):
        gate.observe_drafts("good", 1, 3, 3 if _ % 5 else 1)  # most accepted
    assert gate.alpha("new", 1) == pytest.approx(gate._levels[1].alpha(0.0), abs=0.01)
    assert gate.allows("new", 1, 3)
    steps = 0
    while gate.allows("bad", 1, 3):
        gate.observe_drafts("bad", 1, 3, 0)
        steps += 1
    assert 1 <= steps <= 8 and gate.allows("good", 1, 3)
    gate.release("bad")
    assert gate.allows("bad", 1, 3), "released: its counts are gone"


def test_step_times_are_averaged_per_level_and_kind():
    gate = DraftGate(weight=0.5)
    for seconds in (0.002, 0.004):
        gate.observe_step(1, False, seconds)
    gate.observe_step(2, False, 0.010)
    assert gate._step_s[(1, False)] == pytest.approx(0.003)
    assert gate._step_s[(2, False)] == pytest.approx(0.010) and (1, True) not in gate._step_s


def test_the_counts_kept_are_bounded():
    gate = DraftGate(max_sessions=2)
    for name in ("a", "b", "c"):
        gate.observe_drafts(name, 1, 3, 1)
    assert list(gate._sessions) == ["b", "c"]


def test_a_session_held_back_drafts_every_probe_every_steps_and_resumes_when_they_pay():
    """Held back ``probe_every`` steps in a row, a session drafts the next (a probe); once
    its drafts are accepted again it drafts every step."""
    gate = DraftGate(probe_every=4)
    _timed(gate, 1, 0.003, 0.006)
    for _ in range(10):
        gate.observe_drafts("s", 1, 3, 0)
    allowed = [gate.allows("s", 1, 3) for _ in range(10)]
    assert allowed == [False] * 4 + [True] + [False] * 4 + [True], allowed
    for _ in range(12):
        gate.observe_drafts("s", 1, 3, 3)  # the probes' drafts all accepted now
    assert all(gate.allows("s", 1, 3) for _ in range(6))


def test_the_held_counts_are_bounded_and_released():
    gate = DraftGate(max_sessions=2, probe_every=100)
    _timed(gate, 1, 0.003, 0.006)
    gate.observe_drafts("x", 1, 3, 0)  # the level's α: 0
    for name in ("a", "b", "c"):
        assert not gate.allows(name, 1, 3)
    assert list(gate._held) == ["b", "c"]
    gate.release("c")
    assert list(gate._held) == ["b"]
