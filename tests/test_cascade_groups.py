"""Which groups of rows sharing a prefix attend it once (services/cascade_attention.py
``cascade_groups``), as pure logic: the kernel's blocks of queries, the one-operator pass's
groups of half a block, groups in one segment (kept beside any other rows: the pass stays one
operator), and the positions saved a token that one group (per the prefix kernel's path) and
several groups must reach in a pass over two segments. The passes' speed behind each
rule: tests/test_lean_forward.py checks the paths taken, docs/performance.md the figures."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.cascade_attention import cascade_groups

SEGMENT = 64  # pool slots a segment (services/kv_slab.py POOL_SEGMENT_CPU)


def _rows(slots: list[int]) -> list[SimpleNamespace]:
    return [SimpleNamespace(kv=SimpleNamespace(slot=s)) for s in slots]


def _kept(shared, n: int, isa: str = "avx2", uniform: bool = True, sizes=None,
          slots=None) -> list:
    rows = _rows(slots if slots is not None else list(range(n)))
    return cascade_groups(shared, rows, sizes or [1] * n, set(range(n)), group=2,
                          uniform=uniform, segment=SEGMENT, isa=isa)


def _two_segments(n: int) -> list[int]:
    """Slots of n rows, the second half in the next pool segment: the pass is one operator a
    segment, and groups take it layer by layer."""
    return list(range(n // 2)) + [SEGMENT + s for s in range(n - n // 2)]


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_full_groups_beside_rows_sharing_nothing_in_one_segment_are_kept(isa):
    """Two groups of 8 one-token rows (16 queries a key head each) sharing 480 positions each,
    beside 4 rows that share nothing, in one segment: the pass stays one operator with the
    groups' prefixes in it and the 4 rows attending their own slots (2 x 7 x 480 / 20 = 336
    saved a token is no bar there). Across two segments the same groups would take the pass
    layer by layer, and 336 is under the 500 that several groups must then save."""
    shared = [(list(range(8)), 480), (list(range(8, 16)), 480)]
    assert _kept(shared, 20, isa) == shared
    assert _kept(shared, 20, isa, slots=_two_segments(20)) == []
    one = [(list(range(8)), 160)]  # 7 x 160 / 16 = 70 a token: one operator still
    assert _kept(one, 16, isa) == one
    assert _kept(one, 16, isa, slots=_two_segments(16)) == []


@pytest.mark.parametrize("isa, kept", [("avx512", True), ("avx2", False)])
def test_one_full_group_across_two_segments_needs_200_on_avx512(isa, kept):
    """16 one-token rows sharing 500 positions among 32 in two segments: 15 x 500 / 32 = 234
    saved a token, over the AVX-512 path's 200 for one group and under AVX2's 500; the same
    saving split over two groups is not kept on either path."""
    slots = _two_segments(32)
    one = [(list(range(16)), 500)]
    assert _kept(one, 32, isa, slots=slots) == (one if kept else [])
    two = [(list(range(8)), 1000), (list(range(8, 16)), 1000)]  # 2 x 7 x 1000 / 32 = 437
    assert _kept(two, 32, isa, slots=slots) == []


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_two_full_groups_across_two_segments_saving_560_a_token_pay_on_either_path(isa):
    shared = [(list(range(8)), 800), (list(range(8, 16)), 800)]
    assert _kept(shared, 20, isa, slots=_two_segments(20)) == shared


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_groups_holding_every_row_of_a_one_operator_pass_are_kept_whatever_they_save(isa):
    """Two groups of 8 sharing only 64 positions each (56 saved a token) that hold every row,
    in one segment: the pass stays one operator with each group's prefix in it, so they are
    kept; not four groups of four (half a block each, which on two threads took such passes
    longer) even where they skip 1,536 positions each, nor groups whose rows lie in two
    segments."""
    two = [(list(range(8)), 64), (list(range(8, 16)), 64)]
    assert _kept(two, 16, isa) == two
    halves = [(list(range(4 * g, 4 * g + 4)), 512) for g in range(4)]
    assert _kept(halves, 16, isa) == []
    apart = list(range(8)) + [SEGMENT + s for s in range(8)]
    assert _kept(two, 16, isa, slots=apart) == []


@pytest.mark.parametrize("prefix, kept", [(512, True), (304, False)])
def test_a_one_operator_passs_only_group_of_half_a_block_pays_where_it_skips_enough(prefix,
                                                                                      kept):
    """Four one-token rows (8 queries a key head: half a block) holding the whole pass, in one
    segment: kept where the rows after the first skip 1,500 positions (3 x 512 = 1,536), not
    at 3 x 304 = 912."""
    shared = [(list(range(4)), prefix)]
    assert _kept(shared, 4) == (shared if kept else [])


def test_half_a_block_is_not_enough_for_a_group_beside_others_or_across_segments():
    """Two groups of four sharing 512 each beside rows that share nothing take the pass layer
    by layer: neither is kept; nor is a lone group of four whose rows lie in two pool segments
    (no one-operator pass), nor one in a pass of rows of different sizes; a full block there
    is kept as before."""
    two = [(list(range(4)), 512), (list(range(4, 8)), 512)]
    assert _kept(two, 10) == []
    one = [(list(range(4)), 512)]
    assert _kept(one, 4, slots=[0, 1, SEGMENT, SEGMENT + 1]) == []
    assert _kept(one, 4, uniform=False) == []
    full = [(list(range(8)), 512)]
    assert _kept(full, 8, uniform=False) == full
    assert _kept([(list(range(2)), 800)], 2) == []  # a pair: a quarter of a block
