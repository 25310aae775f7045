"""The session's round state (gateway/session_rounds.py): how a committed round moves the
tokens and each tier's cursor. Pure logic, expected values worked out by hand."""

from __future__ import annotations

import pytest

from gateway.round_result import RoundResult, SpecCache
from gateway.session_rounds import SessionRounds
from services.session_store import Cursor, SessionHandle


def _state(tokens=(1, 2, 3), verifier=3, drafter=3) -> SessionRounds:
    h = SessionHandle(session_id="s", version=1, tokens=list(tokens),
                      verifier=Cursor("v:1", verifier), drafter=Cursor("d:1", drafter))
    return SessionRounds(h)


def _round(drafted=(), accepted=0, extra=9, tail=None, more=(), prefetch=None) -> RoundResult:
    return RoundResult(drafted=drafted, drafter_tail=tail, num_accepted=accepted,
                       extra_token=extra, draft_ms=0.0, verify_ms=1.0, draft_compute_ms=0.0,
                       verify_compute_ms=1.0, more=more, prefetch=prefetch)


def test_a_drafting_round_moves_both_cursors_to_what_each_cache_holds():
    """Drafts 4 5 6, two accepted, the verifier's 9: the verifier's cache holds 1 2 3 4 5
    (it scored the drafts; 9 is not fed yet), the drafter's 1 2 3 4 5 (its 6 was rejected)."""
    s = _state()
    prepared = SpecCache(base=6, branches={})
    r = _round(drafted=(4, 5, 6), accepted=2, tail=(4, 5, 6), prefetch=prepared)
    s.advance(r, r.proposed, started=12.5)
    assert s.tokens == [1, 2, 3, 4, 5, 9]
    assert (s.handle.verifier.length, s.handle.drafter.length) == (5, 5)
    assert (s.handle.verifier.replica, s.handle.drafter.replica) == ("v:1", "d:1")
    assert s.index == 1
    assert s.prefetch is prepared
    assert s.last == (12.5, r)


def test_a_round_cut_by_a_stop_counts_only_the_kept_tokens():
    """All three drafts accepted, but a stop string ends the turn after the first: the
    caches hold 4 past the old tokens, not what the round scored."""
    s = _state()
    r = _round(drafted=(4, 5, 6), accepted=3, tail=(4, 5, 6))
    s.advance(r, [4], started=0.0)
    assert s.tokens == [1, 2, 3, 4]
    assert (s.handle.verifier.length, s.handle.drafter.length) == (4, 4)


def test_a_plain_round_of_several_tokens_leaves_the_drafter_where_it_was():
    """No drafter call (tail None): its cursor stays; the verifier decoded 9 7 8 in three
    passes and holds all but the last."""
    s = _state(drafter=2)
    r = _round(extra=9, more=(7, 8))
    s.advance(r, r.proposed, started=0.0)
    assert s.tokens == [1, 2, 3, 9, 7, 8]
    assert (s.handle.verifier.length, s.handle.drafter.length) == (5, 2)
    assert s.prefetch is None


def test_a_drafter_tail_that_differs_from_what_was_kept_counts_up_to_the_difference():
    """A speculation call left 4 7 2 in the drafter (drafts, then its guess of the
    verifier's token and more); 4 was accepted and the verifier said 9: it holds 1 2 3 4."""
    s = _state()
    r = _round(drafted=(4, 5), accepted=1, tail=(4, 7, 2))
    s.advance(r, r.proposed, started=0.0)
    assert s.tokens == [1, 2, 3, 4, 9]
    assert s.handle.drafter.length == 4


def test_a_resumed_turn_keeps_counting_rounds_from_its_record():
    """The round index seeds each round's draws: a resumed turn goes on from the count it
    had, so that a seeded sample draws what the uncut turn would have."""
    s = SessionRounds(_state().handle, index=7)
    s.advance(_round(), [9], started=0.0)
    assert s.index == 8


def test_a_cursor_moves_forward_resets_and_refuses_a_negative_length():
    c = Cursor("v:1", 3)
    c.advance(10)
    assert (c.replica, c.length) == ("v:1", 10)
    with pytest.raises(ValueError, match="0 or more"):
        c.advance(-1)
    assert c.length == 10
    c.reset()
    assert (c.replica, c.length) == ("", 0)
