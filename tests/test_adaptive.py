"""Adaptive draft length: the expected-tokens formula, the choice of k, the estimators."""

from __future__ import annotations

import random

import pytest

from gateway.adaptive import (
    AdaptiveK,
    CostModel,
    best_k,
    context_level,
    expected_tokens,
    load_level,
)


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
    for _ in range(60):  # then drafts always rejected at once (the 8-token successes of the
        ctl.observe(ctl.next_k() or 1, 0)  # good phase take a while to fade)
    ks = [ctl.next_k() for _ in range(200)]
    assert ks.count(0) >= 180 and 1 in ks[-64:]  # stops speculating, but keeps probing,
    # less and less often while nothing changes, each probe a run of probe_rounds rounds
    starts = [i for i, k in enumerate(ks) if k and i and not ks[i - 1]]
    assert all(ks[i:i + 3] == [1, 1, 1] for i in starts[:-1]), ks
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps[-1] == 64 + 2 and gaps == sorted(gaps), gaps


def test_alpha_is_the_pooled_rate_and_one_bad_round_does_not_stop_speculation():
    """Rounds that drafted 3 and accepted 3, 3, 1, 2 contain 9 successes and 2 first
    rejections: the per-token MLE is 9/11, however the rounds are ordered."""
    model = costs(draft=3.0, base=12.0, per_draft=0.7, rtt=2.0)
    ctl = AdaptiveK(model, k_max=8, prior_rounds=0.0, decay=1.0)
    for accepted in (3, 3, 1, 2):
        ctl.observe(3, accepted)
    assert ctl.alpha == pytest.approx(9 / 11)
    rng = random.Random(1)
    ctl = AdaptiveK(model, k_max=8)
    for _ in range(40):  # steady state at a true per-token α of 0.75
        k = ctl.next_k() or 1
        accepted = 0
        while accepted < k and rng.random() < 0.75:
            accepted += 1
        ctl.observe(k, accepted)
    ctl.observe(3, 0)  # an unlucky round
    assert ctl.alpha > 0.55 and ctl.next_k() >= 2


def test_a_new_request_starts_from_the_gateway_wide_acceptance():
    model = costs()
    first = AdaptiveK(model, k_max=8)
    for _ in range(50):
        first.observe(4, 0)  # this drafter is useless here
    second = AdaptiveK(model, k_max=8)
    assert second.alpha < 0.2 < 0.6 == second.prior_alpha


def test_measured_round_cycles_decide_and_are_interpolated():
    """Cycle times observed at k = 0 and k = 4 (round start to next round start) override the
    component model, which here says k = 0 wins; in between they follow its shape, linearly
    while it is unknown."""
    linear = CostModel()
    linear.observe_cycle(0, 19.0)
    linear.observe_cycle(4, 31.0)
    assert linear.known and linear.round_ms(2) == pytest.approx(25.0)
    model = costs(draft=2.6, base=9.5, per_draft=3.8, rtt=2.9)
    assert best_k(0.7, model, k_max=8) == 0  # 1/12.4 ms beats E(k)/T(k) for every k > 0
    for _ in range(30):
        model.observe_cycle(0, 19.0)  # what target-only decoding really costs per round
        model.observe_cycle(4, 31.0)
    assert model.round_ms(0) == pytest.approx(19.0)
    # Between 0 and 4, along the component model: C(0) = 9.5 + 2.9 = 12.4, C(2) = 2·2.6 +
    # 9.5 + 2·3.8 + 2·2.9 = 28.1, C(4) = 40.9: k = 2 is (28.1 − 12.4) / 28.5 of the way.
    assert model.round_ms(2) == pytest.approx(19.0 + 12.0 * 15.7 / 28.5)
    assert model.round_ms(6) == pytest.approx(31.0 + 2 * (2.6 + 3.8))  # beyond: components
    k = best_k(0.7, model, k_max=8)
    assert k >= 2
    assert expected_tokens(0.7, k) / model.round_ms(k) > 1 / 19.0


def test_costs_are_kept_per_load_level():
    assert [load_level(n) for n in (0, 1, 2, 3, 4, 7, 8, 15, 16)] == [0, 0, 1, 1, 2, 2, 3, 3, 4]


def test_costs_are_kept_per_context_level():
    assert [context_level(n) for n in (0, 255, 256, 511, 512, 1023, 1024)] == [
        0, 0, 1, 1, 2, 2, 3]


def _simulate(ctl: AdaptiveK, model: CostModel, alpha: float, cycle, rounds: int,
              rng: random.Random, catch_up: bool = False, plain: int = 1) -> list[int]:
    """Runs ``rounds`` rounds of a request whose drafts are accepted at a per-token rate of
    ``alpha`` and whose round at k costs ``cycle(k)`` ms (k = 0: per token, as the gateway
    counts a round of ``plain`` tokens); returns the k of each round.
    ``catch_up``: as the gateway does, a drafting round right after one without drafts is
    not measured (the drafter catches up on the undrafted tokens: not warm)."""
    ks = []
    for _ in range(rounds):
        k = ctl.next_k(plain)
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        ctl.observe(k, accepted)
        if not (catch_up and k and ks and ks[-1] == 0):
            model.observe_cycle(k, cycle(k))
        ks.append(k)
    return ks


def test_speculation_stops_when_it_no_longer_pays_though_k0_was_measured_dear():
    """The case measured on the demo pair behind an 800-token context: the drafter's
    acceptance fell to 0.15 and a round with 3 drafts cost 25 ms against 14.5 without, but
    the one k = 0 cycle the gateway had seen was an early, slow one (30 ms). Probing only
    k ± 1 never measured k = 0 again and kept drafting 3 tokens a round (0.84x of
    target-only); the probes must refresh k = 0 too, and then k = 0 must win."""
    model = costs(draft=0.5, base=10.0, per_draft=1.0, rtt=0.5)
    model.observe_cycle(0, 30.0)  # stale
    for k in (1, 2, 3, 4):
        model.observe_cycle(k, 14.5 + 3.5 * k)
    ctl = AdaptiveK(model, k_max=4, prior_alpha=0.6, prior_rounds=4.0)
    ks = _simulate(ctl, model, 0.15, lambda k: 14.5 + 3.5 * k, 200, random.Random(2))
    assert model.round_ms(0) < 18.0  # re-measured (an EWMA: it approaches 14.5)
    tail = ks[-64:]
    assert tail.count(0) >= 48, tail  # no speculation but the probes (1 in 8 rounds)
    # ... and with drafts that pay, the k = 0 probe costs one round in 32
    model = costs(draft=0.5, base=10.0, per_draft=1.0, rtt=0.5)
    ctl = AdaptiveK(model, k_max=4)
    ks = _simulate(ctl, model, 0.8, lambda k: 10.0 + 1.5 * k, 200, random.Random(3))
    tail = ks[-64:]
    assert tail.count(0) <= 3 and sum(tail) / len(tail) >= 2.5, tail


@pytest.mark.parametrize("only", [3, 0])
def test_a_stale_slow_drafting_cycle_is_measured_again(only):
    """Seen on a busy machine at one stream: drafting cycles measured slow early (27 ms,
    against 11 without drafts and 11-13 in steady state) made k = 0 win; each probe that
    followed was one drafting round, which pays the drafter's catch-up and so is never
    measured, and k = 0 won for the rest of the run (1.05 tokens a round instead of 2.9,
    at a per-token acceptance of 0.66). A probe drafts for several rounds in a row, so that
    the later ones are measured."""
    model = costs(draft=1.0, base=9.0, per_draft=0.3, rtt=1.0)
    for _ in range(5):
        model.observe_cycle(0, 11.0)
    for k in range(1, 4):
        model.observe_cycle(k, 40.0)  # stale: measured while the machine was busy
    ctl = AdaptiveK(model, k_max=3, only=only, prior_alpha=0.6)
    assert ctl.next_k() == 0  # (2.18 tokens in 40 ms against 1 in 11; 2.18 in 12.2 truly)
    ks = _simulate(ctl, model, 0.6, lambda k: 11.0 + 0.4 * k, 300, random.Random(4),
                   catch_up=True)
    assert model.round_ms(ks[-1]) < 15.0
    tail = ks[-64:]
    assert tail.count(0) <= 4 and sum(tail) / len(tail) >= 2.0, tail


def test_lone_requests_go_on_with_the_probe_schedule_where_the_last_one_left_it():
    """Behind the 800-token context at one stream, where the demo drafter is accepted at
    ~0.15, the defaults ran at 0.79x target-only (56.4 against 71.8 tokens/s): each request
    restarted the probes' back-off, so each 128-round request drafted in rounds 8-10,
    24-26, 56-58 and 120-122, and a probe round there costs about three plain ones (the
    drafter catches up on the undrafted tokens). The schedule lives with the costs of the
    load and context it probes: the next request goes on from its back-off. When drafts
    pay again, one probe that sees it resets it for all."""
    model = costs(draft=1.0, base=10.0, per_draft=1.0, rtt=0.5)
    for _ in range(10):
        model.observe_cycle(0, 14.5)
        model.observe_cycle(3, 40.0)
    drafting = []
    for i in range(16):  # one request after the other, each its own controller
        ctl = AdaptiveK(model, k_max=3, only=3, prior_alpha=0.6)
        ks = _simulate(ctl, model, 0.15, lambda k: 40.0 if k else 14.5, 128,
                       random.Random(10 + i), catch_up=True)
        drafting.append(sum(1 for k in ks if k))
    # the first request probes at 8, 24, 56 and 120 rounds (3 rounds each, the first
    # probe's first round starts from the prior); later ones every 64 rounds at most
    assert sum(drafting[1:]) <= 15 * 7, drafting
    assert sum(drafting) <= 130, drafting
    # drafts that pay again: a probe sees it, and the next requests draft
    ks = []
    for i in range(4):
        ctl = AdaptiveK(model, k_max=3, only=3, prior_alpha=0.6)
        ks += _simulate(ctl, model, 0.9, lambda k: 16.0 if k else 14.5, 128,
                        random.Random(40 + i), catch_up=True)
    assert sum(1 for k in ks[-128:] if k) >= 100, ks[-128:]


@pytest.mark.parametrize("seed", [0, 1, 3, 5])
def test_a_slow_plain_round_now_and_then_does_not_start_drafting_streaks(seed):
    """Seen at one stream on a Zen 4 EPYC: a plain round's cycle is heavy-tailed (a median
    2.1-2.3 ms a token, p90 3.3-3.7, max 9.5-14.5), and drafting 3 tokens cost ~12.4 ms a
    round against 2.48 ms a token without: it never paid, not even at α = 0.99 (4 tokens in
    12.4 ms). One slow plain round, weighed at up to a half after drafting rounds, set the
    plain estimate at 3.31 ms a token, and the next request drafted 28 of its 30 rounds at
    α 0.91-0.99. Here 5% of the rounds take three times as long: the estimate takes in the
    median of the last three cycles at each k, so a lone slow one moves nothing, and the
    requests draft in their probes only (39 rounds of 640 without any slow round)."""
    def drafting_rounds(window: int) -> int:
        rng = random.Random(seed)

        def cycle(k: int) -> float:
            return (3.0 if rng.random() < 0.05 else 1.0) * (12.4 if k else 2.48)

        model = costs(draft=1.0, base=2.0, per_draft=1.0, rtt=0.5)
        model.window = window
        for _ in range(10):
            model.observe_cycle(0, 2.48)
            model.observe_cycle(3, 12.4)
        drafting = 0
        for i in range(40):  # requests one after another, 16 rounds each
            ctl = AdaptiveK(model, k_max=3, only=3, prior_alpha=0.95)
            ks = _simulate(ctl, model, 0.95, cycle, 16, random.Random(100 + i),
                           catch_up=True, plain=8)
            drafting += sum(1 for k in ks if k)
        return drafting

    assert drafting_rounds(3) <= 58  # the probes' 39, and at most half as many again
    assert drafting_rounds(1) >= 100  # each cycle taken in as it comes: streaks


def test_probes_count_the_tokens_of_plain_rounds():
    """Seen at one stream with plain rounds of 8 tokens (--plain-tokens): two rejected drafts
    at a request's start put its α at 0.56, k = 0 won by a hair (7.5 ms a token against 2.05
    tokens in 16.2 ms), and the probe came after 8 plain *rounds*, 64 tokens, half the
    request, on a pair whose drafts are accepted at ~0.7. The schedule counts tokens: one
    plain round of 8, then a probe; while k = 0 keeps winning the interval doubles up to 64
    rounds, as it did with one-token plain rounds."""
    model = costs(draft=1.0, base=7.0, per_draft=1.0, rtt=0.5)
    for _ in range(10):
        model.observe_cycle(0, 7.5)
        model.observe_cycle(3, 16.2)
    for plain, expect in ((8, [0, 3, 3, 3]), (1, [0] * 7 + [3, 3, 3])):
        model.since_draft = model.probe_backoff = 0
        ctl = AdaptiveK(model, k_max=3, only=3, prior_alpha=0.7)
        ctl.observe(3, 0)
        ctl.observe(3, 0)  # an unlucky start
        assert ctl.alpha < 0.6
        assert [ctl.next_k(plain) for _ in range(len(expect))] == expect


def _probe_gaps(drafting_ms: float, rounds: int = 400) -> list[int]:
    """Rounds between the starts of the probes of a drafter that never pays (accepted at
    0.02; 3 drafts cost ``drafting_ms`` a round against 7.5 ms a token in plain rounds of 8)."""
    model = costs(draft=1.0, base=7.0, per_draft=1.0, rtt=0.5)
    for _ in range(10):
        model.observe_cycle(0, 7.5)
        model.observe_cycle(3, drafting_ms)
    ctl = AdaptiveK(model, k_max=3, only=3, prior_alpha=0.7)
    ks = _simulate(ctl, model, 0.02, lambda k: drafting_ms if k else 7.5, rounds,
                   random.Random(5), catch_up=True, plain=8)
    starts = [i for i, k in enumerate(ks) if k and i and not ks[i - 1]]
    return [b - a for a, b in zip(starts, starts[1:], strict=False)]


def test_probes_of_a_drafter_that_loses_by_less_than_twice_back_off_by_doubling():
    """1.02 tokens in 12 ms against 1 in 7.5 (1.6x): the interval doubles per probe, up to
    64 rounds of 8 tokens (3 drafting rounds each)."""
    gaps = _probe_gaps(12.0)
    assert gaps[:5] == [2 + 3, 4 + 3, 8 + 3, 16 + 3, 32 + 3], gaps  # plain rounds + a probe
    assert set(gaps[5:]) == {64 + 3}, gaps


@pytest.mark.parametrize(("drafting_ms", "cap"), [(40.0, 256), (80.0, 512)])
def test_probes_of_a_drafter_that_loses_by_far_back_off_as_far(drafting_ms, cap):
    """Drafting that loses by r >= 2 (1.02 tokens in 40 ms against 1 in 7.5: 5.2x; in
    80 ms: 10.5x) backs off at least twice as fast as the doubling (at least x4 a probe
    until the cap, once the probes have measured α: at first the request's prior, 0.7,
    makes drafting look better than it is), and the cap is log2(r) doublings higher:
    64 << 2 and 64 << 3 rounds. On an H200 the demo drafter lost by 4.7x, and probing it
    on the doubling schedule cost the defaults ~9% of a 2,048-token cell
    (docs/performance.md)."""
    gaps = [g - 3 for g in _probe_gaps(drafting_ms, rounds=1500)]  # plain rounds between
    rising = gaps[:gaps.index(cap)]
    # (the first step is a doubling or more: the prior α may hide the loss at first)
    assert all(b >= 4 * a for a, b in zip(rising[1:], rising[2:], strict=False)), gaps
    assert gaps[-2:] == [cap] * 2, gaps
    doubling = _probe_gaps(12.0, rounds=1500)
    assert len(gaps) <= len(doubling) // 2, (gaps, doubling)
