"""The paired switch (services/paired_switch.py): pure logic on a simulated clock, in worlds
whose speed moves while the switch measures (a VM's swings, a bench cell's growing
contexts), against the epoch switch it replaced for a verifier's threads."""

from __future__ import annotations

import random

import pytest

from services.epoch_switch import EpochSwitch
from services.paired_switch import PairedSwitch


def _serve(switch, gain: float, speed, seconds: float = 60.0, unit_ms: float = 10.0,
           start: float = 0.0):
    """Units back to back from ``start`` for ``seconds``: each takes ``unit_ms`` at
    ``speed(t)``, divided by ``gain`` in the mode that is on, and yields 16 tokens. Returns
    the modes run."""
    t, modes, previous = start, [], None
    while t < start + seconds:
        if previous is not None:
            switch.observe(previous, t - previous, 16)
        mode = switch.mode(t)
        modes.append(mode)
        previous = t
        t += unit_ms / 1000.0 / speed(t) / (gain if mode else 1.0)
    return modes


def _swinging(t: float) -> float:
    """A machine whose speed jumps between 1.0 and 0.6 every 1.3 s (out of step with 1 s
    epochs) and whose contexts grow through 8 s cells (40% slower by a cell's end)."""
    return (1.0 if int(t / 1.3) % 2 == 0 else 0.6) * (1 - 0.4 * (t % 8.0) / 8.0)


@pytest.mark.parametrize("gain, on", [(1.2, True), (0.85, False)])
def test_the_better_mode_is_kept_on_a_machine_whose_speed_swings(gain, on):
    """Both modes run within milliseconds of each other in an exploring epoch, so the
    swings weigh on both: the better one is kept, and runs nearly all the time."""
    switch = PairedSwitch(epoch_s=1.0, min_rounds=16, on_margin=1.1)
    modes = _serve(switch, gain, _swinging)
    assert switch.incumbent is on
    share = sum(modes[500:]) / len(modes[500:])
    assert (share >= 0.9) if on else (share <= 0.1)
    assert switch.rate[True] / switch.rate[False] == pytest.approx(gain, rel=0.05)


def _random_machine(seed: int):
    """A VM's speed: regimes of 0.3-3 s at 0.55-1.0 of its best (seeded), contexts growing
    through 8 s cells (40% slower by a cell's end), each unit's own time within 10%."""
    rng = random.Random(seed)
    regime = {"until": 0.0, "speed": 1.0}

    def speed(t: float) -> float:
        if t >= regime["until"]:
            regime["speed"], regime["until"] = rng.uniform(0.55, 1.0), t + rng.uniform(0.3, 3.0)
        return regime["speed"] * (1 - 0.4 * (t % 8.0) / 8.0) / rng.uniform(0.9, 1.1)
    return speed


@pytest.mark.parametrize("gain", [1.15, 0.87])
def test_epochs_of_one_mode_against_the_other_measure_the_swings_too(gain):
    """The same kind of world with the epoch switch: whole epochs of each mode, compared
    across the swings and the drift, run the worse mode 1.5-22% of the time here (what the
    paired switch replaced for a verifier's threads); side by side, only its explorations
    run it (~3%). Eight seeded machines, the mode on serving 15% more or 13% less."""
    def worse(make) -> list[float]:
        shares = []
        for seed in range(8):
            modes = _serve(make(), gain, _random_machine(seed), seconds=120.0)[500:]
            shares.append(sum(m != (gain > 1) for m in modes) / len(modes))
        return shares
    by_epochs = worse(lambda: EpochSwitch(epoch_s=1.0, min_rounds=16))
    side_by_side = worse(lambda: PairedSwitch(epoch_s=1.0, min_rounds=16, on_margin=1.1))
    assert max(side_by_side) <= 0.05
    assert sum(by_epochs) / 8 >= 2 * sum(side_by_side) / 8 and max(by_epochs) > 0.1


def test_the_mode_on_is_taken_by_its_margin_and_kept_while_it_serves_more():
    """``on_margin`` 1.1: 5% more does not take the mode that is on (two threads cost a pass
    nearly twice the CPU); once taken, an exploration that measures it 5% ahead keeps it,
    and one where the mode off serves more drops it."""
    steady = PairedSwitch(epoch_s=1.0, min_rounds=16, on_margin=1.1)
    _serve(steady, 1.05, lambda t: 1.0, seconds=20.0)
    assert steady.incumbent is False
    taken = PairedSwitch(epoch_s=1.0, min_rounds=16, on_margin=1.1)
    _serve(taken, 1.2, lambda t: 1.0, seconds=5.0)
    assert taken.incumbent is True
    _serve(taken, 1.05, lambda t: 1.0, seconds=30.0, start=5.0)
    assert taken.incumbent is True and taken.rate[True] / taken.rate[False] < 1.1
    _serve(taken, 0.9, lambda t: 1.0, seconds=40.0, start=35.0)
    assert taken.incumbent is False


def test_explorations_mix_the_modes_and_come_back_less_often_while_the_kept_one_wins():
    switch = PairedSwitch(epoch_s=1.0, min_rounds=4)
    modes = _serve(switch, 1.5, lambda t: 1.0, seconds=40.0, unit_ms=100.0)
    assert set(modes[:10]) == {True, False}  # the first epoch explores: both modes
    # after the first comparison the kept mode runs whole epochs; explorations (units of
    # either mode) come after 2, then 4, 8, 16 epochs of it
    starts = [i for i in range(1, len(modes)) if not modes[i] and all(modes[i - 6:i])]
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert len(gaps) >= 3 and all(b >= 1.6 * a for a, b in zip(gaps, gaps[1:], strict=False))
    assert switch.incumbent is True


def test_units_in_chains_with_a_gap_after_each_rate_both_modes_alike():
    """A verifier's passes come in chains: a plain round's 8 back to back, then a gap of
    half a chain while the answers travel. Modes in strict turns would hand every gap to
    the same mode (the chain's last pass) and rate it at less than half the other; at
    random both modes take their share of the gaps."""
    switch = PairedSwitch(epoch_s=1.0, min_rounds=16)
    t, previous = 0.0, None
    while t < 30.0:
        for unit in range(8):
            if previous is not None:
                switch.observe(previous, t - previous, 16)
            switch.mode(t)
            previous = t
            t += 0.010 + (0.040 if unit == 7 else 0.0)
    assert switch.rate[True] / switch.rate[False] == pytest.approx(1.0, abs=0.12)


def test_only_the_last_unit_given_is_observed():
    """A cycle reported for a unit the switch did not give last (another level's) is not
    counted, nor is a unit whose cycle was never reported."""
    switch = PairedSwitch(epoch_s=10.0, min_rounds=2)
    assert switch.mode(0.0) is True  # the Thue-Morse order: on, off, off, on, ...
    switch.observe(-1.0, 0.5, 16)  # not the last unit given
    assert switch.mode(0.01) is False  # (the first unit's cycle is never reported)
    switch.observe(0.01, 0.01, 16)
    assert switch.mode(0.02) is False
    switch.observe(0.02, 0.01, 16)
    assert switch.mode(0.03) is True
    switch.observe(0.03, 0.01, 16)
    switch.mode(10.02)  # the epoch ends: 16 tokens per 10 ms unit in each mode
    assert switch.rate == {True: pytest.approx(1600.0), False: pytest.approx(1600.0)}
    assert switch.incumbent is False  # a tie: the mode that is off (cheaper)
    assert switch.kept_changed() and not switch.kept_changed()  # said once


@pytest.mark.parametrize("gain, cut", [(0.5, True), (0.9, False), (1.3, False)])
def test_an_exploration_the_mode_on_loses_widely_ends_after_a_quarter_epoch(gain, cut):
    """With ``cut_below`` 0.7, an exploration in which the mode that is on serves half as
    much ends once a quarter of its epoch ran (and the units of each an epoch needs), not
    after the epoch: it keeps the mode that is off. One it loses by less, or wins, runs its
    whole epoch."""
    switch = PairedSwitch(epoch_s=1.0, min_rounds=16, cut_below=0.7)
    modes = _serve(switch, gain, lambda t: 1.0, seconds=0.6)
    if cut:
        assert switch.rate and not switch.incumbent
        assert switch.rate[True] < 0.7 * switch.rate[False]
        assert switch._every == switch.max_explore, "tried again as late as any"
        # a quarter epoch (250 ms) of units of 20 ms (on) and 10 ms (off), half each: about
        # 8 on; a whole epoch would have run about 33
        assert 6 <= sum(modes) <= 12, sum(modes)
    else:
        assert not switch.rate, "the exploration still runs"
    plain = PairedSwitch(epoch_s=1.0, min_rounds=16)  # cut_below 0: never cut
    _serve(plain, 0.5, lambda t: 1.0, seconds=0.6)
    assert not plain.rate


def test_a_wide_loss_of_the_kept_mode_is_explored_again_soon():
    """A cut exploration delays the next one to ``max_explore`` epochs only where the mode
    that is on was not kept before it (the loss confirms). Where it was kept (it won the
    exploration before), the cut stops it and the next exploration comes after
    ``first_explore`` epochs, as after any change: one quarter-epoch read of a few units
    must not stop a mode that won for 16 epochs (a verifier's local drafts at one stream,
    services/paired_switch.py ``_losing``)."""
    switch = PairedSwitch(epoch_s=1.0, min_rounds=16, cut_below=0.7)
    _serve(switch, 1.5, lambda t: 1.0, seconds=1.05)  # the first exploration: on wins
    assert switch.incumbent and switch.rate[True] > 1.4 * switch.rate[False]
    t, explorations = 1.05, []
    while len(explorations) < 2 and t < 60.0:  # from now on the mode that is on loses widely
        before = dict(switch.rate)
        _serve(switch, 0.5, lambda t: 1.0, seconds=0.05, start=t)
        t += 0.05
        if switch.rate != before:
            explorations.append((t, switch.incumbent, switch._every))
    (first_at, kept, every), (second_at, kept2, every2) = explorations
    assert kept is False and every == switch.first_explore, "stopped, tried again soon"
    # the second comes after first_explore epochs of the kept mode (~2-3 s), not 16
    assert second_at - first_at < 4.0, explorations
    assert kept2 is False and every2 == switch.max_explore, "the loss confirmed: as late as any"


def _explorations(switch, gain: float, speed, start: float, seconds: float) -> list[float]:
    """Serves as ``_serve`` does, in slices of 50 ms; returns when the explorations ended."""
    ended, t = [], start
    while t < start + seconds:
        before = dict(switch.rate)
        _serve(switch, gain, speed, seconds=0.05, start=t)
        t += 0.05
        if switch.rate != before:
            ended.append(t)
    return ended


@pytest.mark.parametrize("recheck", [True, False])
def test_with_recheck_a_kept_mode_that_falls_below_the_other_is_explored_at_once(recheck):
    """``recheck``: an epoch in which the kept mode serves less than the other mode served at
    the last exploration calls the next exploration at once. Here the mode on wins (1.6x)
    for 40 s, by when explorations come every 16 epochs; then the work changes (the mode on
    serves 0.8x, and everything runs at 0.7 of the speed: long prompts after short ones for
    a verifier's local drafts). With recheck the switch stops it within three seconds;
    without, it runs on until the next scheduled exploration, past the 6 s watched."""
    switch = PairedSwitch(epoch_s=1.0, min_rounds=16, on_margin=1.05, recheck=recheck)
    _serve(switch, 1.6, lambda t: 1.0, seconds=40.0)
    assert switch.incumbent and switch._every == switch.max_explore
    ended = _explorations(switch, 0.8, lambda t: 0.7, start=40.0, seconds=6.0)
    if recheck:
        assert ended and ended[0] < 43.0 and not switch.incumbent, ended
        assert switch.rate[False] > switch.rate[True]
    else:
        assert not ended and switch.incumbent


def test_a_slower_machine_alone_does_not_call_an_exploration():
    """The same switch with recheck where only the machine slows (0.7x) and the mode on
    still wins: its epochs still serve more than the other mode did at the last
    exploration, so explorations keep their schedule (none in the 6 s watched)."""
    switch = PairedSwitch(epoch_s=1.0, min_rounds=16, on_margin=1.05, recheck=True)
    _serve(switch, 1.6, lambda t: 1.0, seconds=40.0)
    assert not _explorations(switch, 1.6, lambda t: 0.7, start=40.0, seconds=6.0)
    assert switch.incumbent
