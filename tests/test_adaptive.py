"""Adaptive draft length: the expected-tokens formula, the choice of k, the estimators."""

from __future__ import annotations

import random

import pytest

from gateway.adaptive import AdaptiveK, CostModel, best_k, expected_tokens


def costs(draft=1.0, base=10.0, per_draft=0.5, rtt=0.5) -> CostModel:
    return CostModel(draft_ms_per_token=draft, verify_ms_base=base,
                     verify_ms_per_draft=per_draft, rtt_ms=rtt)


def test_expected_tokens_matches_a_simulation():
    rng = random.Random(0)
    for alpha, k in ((0.3, 2), (0.8, 5), (0.95, 8)):
        trials = 20000
        total = 0
        for _ in range(trials):
            accepted = 0
            while accepted < k and rng.random() < alpha:
                accepted += 1
            total += accepted + 1
        assert expected_tokens(alpha, k) == pytest.approx(total / trials, rel=0.02)
    assert expected_tokens(1.0, 4) == 5 and expected_tokens(0.0, 4) == 1


BEST_K = [
    ("high acceptance, cheap drafts: draft long", 0.9, costs(draft=0.5), lambda k: k >= 6),
    ("low acceptance: do not speculate", 0.05, costs(draft=2.0), lambda k: k == 0),
    ("drafting as dear as verifying: no speculation", 0.6, costs(draft=12.0), lambda k: k == 0),
    ("middling acceptance: a short draft", 0.5, costs(draft=1.0), lambda k: 1 <= k <= 4),
]


@pytest.mark.parametrize("alpha, model, expect", [c[1:] for c in BEST_K],
                         ids=[c[0] for c in BEST_K])
def test_best_k(alpha, model, expect):
    k = best_k(alpha, model, k_max=10)
    assert expect(k), k
    rate = [expected_tokens(alpha, j) / model.round_ms(j) for j in range(11)]
    assert rate[k] == max(rate)  # it really is the argmax


def test_cost_model_learns_linear_verify_cost():
    m = CostModel(weight=0.5)
    for _ in range(20):
        m.observe(0, draft_ms=0, verify_ms=11, draft_compute_ms=0, verify_compute_ms=10)
        m.observe(4, draft_ms=9, verify_ms=13, draft_compute_ms=8, verify_compute_ms=12)
    assert m.known
    assert m.verify_ms_base == pytest.approx(10)
    assert m.verify_ms_per_draft == pytest.approx(0.5)
    assert m.draft_ms_per_token == pytest.approx(2)
    assert m.rtt_ms == pytest.approx(1, abs=0.05)


def test_controller_measures_then_tracks_acceptance():
    model = CostModel()
    ctl = AdaptiveK(model, k_max=8)
    assert ctl.next_k() == 0  # plain verify first
    model.observe(0, 0, 10.5, 0, 10)
    assert ctl.next_k() == 8  # then a full draft
    model.observe(8, 9, 15, 8, 14)
    for _ in range(30):  # drafts always accepted
        ctl.observe(8, 8)
    assert ctl.alpha > 0.9 and ctl.next_k() >= 6
    for _ in range(30):  # drafts always rejected at once
        ctl.observe(ctl.next_k() or 1, 0)
    ks = [ctl.next_k() for _ in range(16)]
    assert ks.count(0) >= 12 and 1 in ks  # stops speculating, but keeps probing
