"""Steal (services/steal.py): the CPU time a virtual machine's host gave to other guests, read
from /proc/stat, and the epoch switches' rates net of it (services/epoch_switch.py, pure
logic on a simulated clock)."""

from __future__ import annotations

import time

import pytest

from services import steal
from services.epoch_switch import EpochSwitch

STAT = "cpu  {user} 5 {system} 9000 40 3 2 {steal} 0 0\ncpu0  1 2 3 4 5 6 7 8 0 0\n"


def test_a_reading_is_stolen_and_demanded_ticks_over_every_cpu(tmp_path):
    """Demanded: user + nice + system + irq + softirq + steal (idle and iowait are not)."""
    stat = tmp_path / "stat"
    stat.write_text(STAT.format(user=100, system=30, steal=12))
    assert steal.read(stat) == (12, 100 + 5 + 30 + 3 + 2 + 12)
    stat.write_text("intr 1 2 3\n")
    assert steal.read(stat) is None  # no cpu line first
    stat.write_text("cpu  1 2 3 4\n")
    assert steal.read(stat) is None  # a kernel without the steal field
    assert steal.read(tmp_path / "missing") is None


def test_the_share_is_of_the_time_demanded_between_two_readings():
    assert steal.share((10, 100), (13, 140)) == pytest.approx(3 / 40)
    assert steal.share(None, (1, 2)) is None and steal.share((1, 2), None) is None
    assert steal.share((1, 5), (1, 5)) is None  # nothing ran in between
    # what is left of the interval: a rate divided by it at most doubles
    assert steal.net((10, 100), (13, 140)) == pytest.approx(1 - 3 / 40)
    assert steal.net((0, 0), (90, 100)) == steal.net((0, 0), (50, 100)) == 0.5
    assert steal.net(None, (1, 2)) == 1.0
    before = steal.read()  # this Linux machine counts it, and the counters only grow
    time.sleep(0.05)
    after = steal.read()
    assert before is not None and after[1] >= before[1] and after[0] >= before[0]


def test_a_clock_reads_the_counters_again_only_once_a_tick_has_passed():
    """A gateway asks every round; /proc/stat counts in ticks of 10 ms, so a reading younger
    than ``every_s`` is given again and an older one is read anew."""
    readings = iter([(1, 10), (2, 20), (3, 30)])
    now = [100.0]
    clock = steal.Clock(lambda: next(readings), every_s=0.01, now=lambda: now[0])
    assert clock() == (1, 10)
    now[0] += 0.009
    assert clock() == (1, 10)  # within the tick: not read again
    now[0] += 0.001
    assert clock() == (2, 20)  # a tick after the first reading
    now[0] += 0.5
    assert clock() == (3, 30)
    none = steal.Clock(lambda: None)
    assert none() is None and none() is None


class _Host:
    """A steal clock the test moves: ``stolen`` ticks of every ``demanded`` from now on."""

    def __init__(self) -> None:
        self.ticks = [0, 0]
        self.stolen_share = 0.0

    def advance(self, demanded: int = 100) -> None:
        self.ticks[0] += round(demanded * self.stolen_share)
        self.ticks[1] += demanded

    def read(self) -> tuple[int, int]:
        return tuple(self.ticks)


def _run(switch: EpochSwitch, host: _Host, true_rate: dict[bool, float], stolen_on: bool,
         epochs: int = 24) -> list[bool]:
    """Epochs of 0.5 s, ten 50-ms units each; the host steals 30% of the CPUs' time whenever
    mode ``stolen_on`` runs (a burst that happens to fall on it), which slows it by that
    share. Returns the kept mode after each epoch."""
    kept, now = [], 0.0
    for _ in range(epochs):
        for _unit in range(10):
            mode = switch.mode(now)
            host.stolen_share = 0.3 if mode == stolen_on else 0.0
            host.advance()
            switch.observe(now, 0.05, true_rate[mode] * (1 - host.stolen_share) * 0.05)
            now += 0.05
        kept.append(switch.incumbent)
    return kept


def test_a_mode_that_ran_while_the_host_stole_time_is_judged_by_what_it_served_net_of_it():
    """Two modes, True serving 100 tokens/s and False 90, and a host that takes 30% of the
    CPUs whenever True runs: True measures 70. Without the steal clock the switch keeps the
    worse mode, False; with it, True, rated at its 100."""
    rates = {True: 100.0, False: 90.0}
    blind = EpochSwitch()
    assert _run(blind, _Host(), rates, stolen_on=True)[-1] is False
    assert blind.rate[True] == pytest.approx(70.0)
    host = _Host()
    aware = EpochSwitch(steal=host.read)
    assert _run(aware, host, rates, stolen_on=True)[-4:] == [True] * 4
    assert aware.rate[True] == pytest.approx(100.0) and aware.rate[False] == pytest.approx(90.0)
    assert aware.seeded().steal == host.read  # a new load level's switch corrects too


def test_a_correction_never_more_than_doubles_a_rate():
    host = _Host()
    switch = EpochSwitch(steal=host.read, epoch_s=0.5, min_rounds=1)
    switch.mode(0.0)
    host.stolen_share = 0.9  # (a VM starved for a while)
    host.advance()
    switch.observe(0.0, 0.5, 10.0)
    switch.mode(0.5)  # ends the epoch: 20 tokens/s measured, 40 at most
    assert switch.rate[True] == pytest.approx(40.0)
