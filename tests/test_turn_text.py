"""Where a turn ends and what its stream shows (gateway/turn_text.py), on a real tokenizer:
expected texts are the tokenizer's own decode of the same ids, never the code under test."""

from __future__ import annotations

import pytest

from gateway.chunks import Finish
from gateway.turn_text import TurnText
from services.tiny_models import build_tokenizer

TEXT = "def add(a, b):\n    return a + b  # café\n"
EOS = 10_000  # an id no text encodes to: the end of sequence of these tests


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("turn_text_tok"))


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


def _turn(tok, stop=()) -> TurnText:
    return TurnText(tok, _ids(tok, "# prompt\n"), stop, [EOS])


def test_the_budget_ends_the_turn_and_its_whole_text_equals_a_decode(tok):
    ids = _ids(tok, TEXT)
    turn = _turn(tok)
    first, text1, finish1 = turn.accept(ids[:3], budget=len(ids) - 2, room=1000)
    rest, text2, finish2 = turn.accept(ids[3:], budget=len(ids) - 2 - 3, room=1000)
    assert (first, finish1) == (ids[:3], None)
    assert (rest, finish2) == (ids[3:-2], Finish.LENGTH)
    assert text1 + text2 == tok.decode(ids[:-2])


def test_an_end_of_sequence_is_kept_shows_no_text_and_drops_what_follows(tok):
    ids = _ids(tok, "x = 1")
    kept, text, finish = _turn(tok).accept([*ids, EOS, *ids], budget=100, room=1000)
    assert kept == [*ids, EOS]
    assert (text, finish) == ("x = 1", Finish.EOS)


def test_a_stop_string_ends_the_turn_and_is_not_shown(tok):
    ids = _ids(tok, TEXT)
    kept, text, finish = _turn(tok, stop=("return",)).accept(ids, budget=100, room=1000)
    assert finish is Finish.STOP
    assert text == "def add(a, b):\n    "
    assert len(kept) < len(ids)  # the tokens after the stop are not kept


def test_the_context_ends_the_turn_when_the_round_fills_it(tok):
    ids = _ids(tok, TEXT)
    kept, text, finish = _turn(tok).accept(ids[:4], budget=100, room=4)
    assert (kept, finish) == (ids[:4], Finish.CONTEXT)
    assert text == tok.decode(ids[:4])


def test_a_replayed_stream_shows_exactly_what_the_uncut_one_had_left(tok):
    """Cut after 5 tokens: the replay shows the rest, and with the turn's finish its tail."""
    ids = _ids(tok, TEXT)
    uncut = _turn(tok)
    head = uncut.accept(ids[:5], budget=100, room=1000)[1]
    tail = uncut.accept(ids[5:], budget=len(ids) - 5, room=1000)[1]
    text, finish = _turn(tok).replay(ids[:5], ids[5:], Finish.LENGTH)
    assert head + text == head + tail == tok.decode(ids)
    assert finish is Finish.LENGTH
    assert _turn(tok).replay(ids[:5], ids[5:], None) == (tail, None)
