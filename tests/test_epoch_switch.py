"""The epoch switch shared by the gateway's load switch and a verifier's plain threads
(services/epoch_switch.py), where rates drift: pure logic on a simulated clock.

Under load a mode's rate is not constant: as a cell's contexts grow, each pass attends over
more positions, and on the demo pair at 16 streams a verifier's session-tokens per second
fell from 1265 to 844 within one 512-token bench cell (docs/performance.md). A switch that
weighs the incumbent's current average against the other mode's rate from epochs ago
takes that drift for a difference between the modes."""

from __future__ import annotations

import pytest

from services.epoch_switch import EpochSwitch


def _epoch(switch: EpochSwitch, start: float, rate: float) -> bool:
    """One epoch of 0.5 s from ``start`` at ``rate`` tokens per second (ten units of 50 ms);
    the mode it ran. (An epoch is rated when the next one begins.)"""
    mode = switch.mode(start)
    for i in range(10):
        switch.mode(start + 0.05 * i)
        switch.observe(start + 0.05 * i, 0.05, rate * 0.05)
    return mode


def test_between_explorations_the_incumbent_stays_while_its_rate_drifts_below_the_others():
    """Both modes slow down as contexts grow: the incumbent's epochs measure that, the
    other mode's last rate does not, and that is no reason to switch."""
    switch = EpochSwitch()
    assert _epoch(switch, 0.0, 100.0) is True
    assert _epoch(switch, 0.5, 90.0) is False  # the other mode, measured once
    assert _epoch(switch, 1.0, 70.0) is True  # 100 against 90: the better one kept
    # its average (100 + 70) / 2 = 85 is now below the other's 90 from two epochs ago
    assert _epoch(switch, 1.5, 66.0) is True
    assert switch.rate == pytest.approx({True: 85.0, False: 90.0})
    assert switch.seeded().on is True  # a new load level starts from the kept mode too
    # the other mode is tried again on schedule (after 2 epochs) ...
    assert _epoch(switch, 2.0, 60.0) is False
    assert switch.rate[True] == pytest.approx(75.5)
    # ... and judged by its own epoch, not one averaged with the stale 90
    assert _epoch(switch, 2.5, 65.0) is True
    assert switch.rate[False] == pytest.approx(60.0)


def test_an_explored_mode_that_is_better_now_wins_though_its_old_rate_was_lower():
    """Rates that rise (load arriving): the other mode's old rate understates it."""
    switch = EpochSwitch()
    _epoch(switch, 0.0, 50.0)
    _epoch(switch, 0.5, 45.0)
    assert _epoch(switch, 1.0, 60.0) is True
    assert _epoch(switch, 1.5, 70.0) is True
    assert _epoch(switch, 2.0, 75.0) is False  # explored on schedule
    assert switch.rate[True] == pytest.approx(62.5)
    # 75 against the incumbent's 62.5 (averaged with the old 45 it would have been 60): it
    # runs one more epoch to confirm, and is kept
    assert _epoch(switch, 2.5, 75.0) is False
    assert switch.rate[False] == pytest.approx(75.0) and switch.exploring
    assert _epoch(switch, 3.0, 80.0) is False
    assert switch.incumbent is False and not switch.exploring


def test_an_explored_mode_that_wins_one_lucky_epoch_is_not_kept():
    """One epoch's rate is noisy (a bench cell's first rounds, a burst on the other cores):
    an explored mode that wins it runs one more epoch and is kept only if the two epochs'
    average wins too. (Explored epochs run whole here: ``cut_below`` 0.)"""
    switch = EpochSwitch(cut_below=0.0)
    _epoch(switch, 0.0, 100.0)
    _epoch(switch, 0.5, 60.0)
    assert _epoch(switch, 1.0, 100.0) is True  # 100 against 60
    assert _epoch(switch, 1.5, 100.0) is True
    assert _epoch(switch, 2.0, 110.0) is False  # explored on schedule: a lucky epoch
    assert _epoch(switch, 2.5, 50.0) is False  # 110 against 100: confirming
    assert switch.incumbent is True and switch.exploring
    assert _epoch(switch, 3.0, 100.0) is True  # (110 + 50) / 2 = 80 against 100: not kept
    assert switch.rate[False] == pytest.approx(80.0) and not switch.exploring


def _share_on(ratio: float, seconds: float = 60.0) -> float:
    """The share of 50 ms units run in the ``on`` mode after the first two epochs, in a
    world of 15 s cells whose rates fall by 40% from start to end (contexts growing), the
    mode that is off yielding ``ratio`` times what the one that is on does."""
    switch, t, modes = EpochSwitch(), 0.0, []
    while t < seconds:
        mode = switch.mode(t)
        modes.append(mode)
        rate = 100.0 * (1 - 0.4 * (t % 15.0) / 15.0) * (1.0 if mode else ratio)
        switch.observe(t, 0.05, rate * 0.05)
        t += 0.05
    return sum(modes[20:]) / len(modes[20:])


def test_modes_five_percent_apart_keep_the_better_one_through_the_drift():
    """A comparison with stale rates ran the worse mode 43% of the time here (weighing the
    incumbent's falling average against the other's older, higher rate); only explorations
    should run it, 1 epoch in 3 at most while the switch learns the drift anew each cell."""
    assert _share_on(0.95) >= 0.85
    assert _share_on(1.05) <= 0.15
    assert _share_on(0.8) >= 0.9  # a wide gap: explored less often


def test_kept_changed_says_once_when_the_kept_mode_changes_never_mid_exploration():
    """The cue both switches' callers log on (the gateway's load switch, a verifier's
    threads): not before both modes were measured, not while a mode is tried or confirmed.
    (Explored epochs run whole here: ``cut_below`` 0.)"""
    switch, seen = EpochSwitch(cut_below=0.0), []
    for start, rate in [(0.0, 100.0), (0.5, 60.0), (1.0, 100.0), (1.5, 100.0),
                        (2.0, 130.0), (2.5, 130.0), (3.0, 60.0), (3.5, 60.0)]:
        _epoch(switch, start, rate)
        seen.append((switch.kept_changed(), switch.exploring))
    # (an epoch is rated when the next begins)
    assert seen == [(False, False),  # nothing rated yet
                    (False, True),  # one mode measured, the other being measured
                    (True, False),  # both measured: the better (on) kept, said once
                    (False, False),
                    (False, True),  # the other mode tried (130) ...
                    (False, True),  # ... won, and is confirmed: not yet
                    (True, False),  # kept: said once
                    (False, False)]
    assert switch.incumbent is False


def test_an_explored_epoch_that_loses_widely_ends_after_half_an_epoch():
    """A load level's first drafting epoch ran at 0.6 of its plain ones on the demo pair at
    8 streams (docs/performance.md): once half an epoch and ``min_rounds`` units say the
    explored mode runs below ``cut_below`` of the incumbent, the rest of the epoch is not
    run. It counts as a wide loss (tried again later than a near one). A mode that is close
    runs its whole epoch, and a confirming epoch always does."""

    def units(switch: EpochSwitch, start: float, rate: float, n: int) -> list[bool]:
        modes = []
        for i in range(n):  # units of 25 ms: 20 an epoch
            modes.append(switch.mode(start + 0.025 * i))
            switch.observe(start + 0.025 * i, 0.025, rate * 0.025)
        return modes

    switch = EpochSwitch(on=False, rate={False: 100.0}, patient=True)
    switch._streak = switch._every - 1  # the next epoch explores
    units(switch, 0.0, 100.0, 20)  # the incumbent's epoch
    explored = units(switch, 0.5, 60.0, 20)  # drafting, at 0.6
    assert explored == [True] * 10 + [False] * 10  # cut after 0.25 s
    assert switch.rate[True] == pytest.approx(60.0) and not switch.exploring
    assert switch._every == 4 * switch.first_explore  # a wide loss
    close = EpochSwitch(on=False, rate={False: 100.0}, patient=True)
    close._streak = close._every - 1
    units(close, 0.0, 100.0, 20)
    assert units(close, 0.5, 85.0, 20) == [True] * 20  # 0.85: the whole epoch
    confirm = EpochSwitch(on=False, rate={False: 100.0}, patient=True)
    confirm._streak = confirm._every - 1
    units(confirm, 0.0, 100.0, 20)
    assert units(confirm, 0.5, 120.0, 20) == [True] * 20  # it won: one more epoch confirms
    assert units(confirm, 1.0, 60.0, 20) == [True] * 20  # confirming at 0.6: not cut
    assert confirm.mode(1.5) is False  # rated as the next begins: (120 + 60) / 2 lost
    assert not confirm.exploring and confirm.incumbent is False
    assert EpochSwitch(cut_below=0.5).seeded().cut_below == 0.5


def test_an_explored_epoch_far_below_ends_after_a_quarter_and_is_tried_again_much_later():
    """On the demo pair at 8 streams on a 2-core CPU drafting ran at 0.52-0.57 of not
    drafting (docs/performance.md): below ``cut_early`` (0.6) of the incumbent's rate an
    explored epoch ends after a quarter of an epoch, between 0.6 and ``cut_below`` after
    half; such a far loss lets the interval grow to ``max_far`` epochs, and a closer loss
    after it brings the interval back within ``max_explore``."""

    def explored_units(switch: EpochSwitch, start: float, rate: float) -> int:
        n = 0  # units of 10 ms: 50 an epoch
        while switch.mode(start + 0.01 * n) is True:
            switch.observe(start + 0.01 * n, 0.01, rate * 0.01)
            n += 1
        return n

    def exploring_next(rate_kept: float = 100.0, every: int = 2) -> EpochSwitch:
        switch = EpochSwitch(on=False, rate={False: rate_kept}, patient=True, _every=every)
        switch._streak = switch._every - 1  # the next epoch explores
        switch.mode(0.0)
        for i in range(50):  # the incumbent's epoch
            switch.mode(0.01 * i)
            switch.observe(0.01 * i, 0.01, rate_kept * 0.01)
        return switch

    far = exploring_next()
    assert explored_units(far, 0.5, 50.0) == 13  # a quarter of an epoch (and 8 units)
    assert far._every == 8 and far.rate[True] == pytest.approx(50.0)
    assert explored_units(exploring_next(), 0.5, 70.0) == 25  # half
    assert explored_units(exploring_next(), 0.5, 85.0) == 50  # the whole epoch
    late = exploring_next(every=16)
    explored_units(late, 0.5, 50.0)
    assert late._every == 64  # 4 x 16, past max_explore
    later = exploring_next(every=64)
    later.rate[True] = 50.0
    explored_units(later, 0.5, 70.0)
    assert later._every == later.max_explore  # lost by less: tried again sooner
    seeded = EpochSwitch(cut_early=0.5, far_margin=0.4, max_far=32).seeded()
    assert (seeded.cut_early, seeded.far_margin, seeded.max_far) == (0.5, 0.4, 32)
