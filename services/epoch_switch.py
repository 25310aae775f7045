"""Two modes of running the same work, compared by the throughput each gives, in epochs.

The switch runs the work in epochs of one mode (at least ``epoch_s`` and ``min_rounds``
units), and measures each epoch's tokens per second: the tokens of the units that began in
it over those units' cycle times (from a unit's start to the next one's, so that what a mode
costs the rest of the system between units counts too). It keeps the better mode and tries
the other one again after 2 epochs, then 4, 8 and 16 while the incumbent keeps winning (2, 8,
16 when the other mode reached less than 0.8 of its rate; 2, 8, 32, 64 when less than 0.6):
with a 1.5x difference, 1 epoch in 17 costs about 2%. An explored epoch that runs below 0.8
of the incumbent's rate after half an epoch ends there (``cut_below``), below 0.6 after a
quarter (``cut_early``): the rest would only cost more. On the demo pair on a 2-core CPU
drafting ran at 0.52-0.57 of not drafting at 8 streams (0.49-0.55 at 16), and each
half-epoch exploration, with the drafter's catch-up on every session before it, cost a
2-second bench cell 3-11% of its tokens (docs/performance.md). A tie goes to the mode that
is off (``on`` False), the cheaper one.
A switch whose first mode came from evidence (``patient``) measures the other mode on the
usual schedule, after ``first_explore`` epochs, not at once.

Modes are compared only when the other one has just run: an explored epoch's own rate
against the incumbent's latest average. Rates drift under load (each pass attends over more
positions as contexts grow: at 16 streams a verifier's rate fell by a third within one
512-token bench cell), and the incumbent's falling average weighed against the other mode's
rate from epochs earlier switched to the worse mode on the drift alone. An explored mode
that wins runs one more epoch and is kept only if the two epochs' average wins too: one
epoch's luck would otherwise hand it the next ``first_explore`` epochs.

On a virtual machine an epoch's rate is also low by the share of the CPUs' time the host
gave to other guests meanwhile (steal, services/steal.py): with a ``steal`` clock (the
services pass ``steal.read``) each epoch's rate is divided by ``1 - share``, so that a burst
of it does not decide for the mode that happened to run under it.

Used by the gateway: whether loaded requests draft (gateway/load_switch.py) and whether lone
requests' rounds draft trees (gateway/tree_width.py). A verifier's thread choice, whose modes
can take turns pass by pass, compares them side by side instead (services/paired_switch.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from services import steal as stolen


@dataclass
class EpochSwitch:
    epoch_s: float = 0.5
    min_rounds: int = 8
    weight: float = 0.5  # of an epoch's rate in its mode's running average
    first_explore: int = 2  # epochs of the incumbent before the other mode is tried again
    max_explore: int = 16  # ... doubling while the incumbent keeps winning, up to this
    wide_margin: float = 0.8  # (quadrupling while the other mode's rate is below this share)
    far_margin: float = 0.6  # ... and while below this share, up to ``max_far`` epochs
    max_far: int = 64
    cut_below: float = 0.8  # an explored epoch running below this share of the incumbent's
    #                         rate after half an epoch ends there (0: never)
    cut_early: float = 0.6  # ... below this share, after a quarter of an epoch
    on: bool = True  # the mode of the current epoch
    patient: bool = False  # the first mode came from evidence: explore on schedule
    rate: dict[bool, float] = field(default_factory=dict)  # per mode: tokens per second of cycles
    steal: Callable[[], tuple[int, int] | None] | None = None  # services/steal.py ``read``
    _exploring: bool = False  # this epoch tries the mode that is not the incumbent
    _confirming: bool = False  # ... for a second epoch, after it won the first
    _reported: bool | None = None  # the kept mode ``kept_changed`` last reported
    _every: int = 0
    _streak: int = 0
    _start: float | None = None
    _last: float = 0.0
    _tokens: int = 0
    _busy_s: float = 0.0
    _rounds: int = 0
    _stolen_at: tuple[int, int] | None = None  # the steal clock when the epoch began

    def __post_init__(self) -> None:
        self._every = self._every or self.first_explore

    @property
    def incumbent(self) -> bool:
        """The mode kept between explorations."""
        return self.on != self._exploring

    @property
    def exploring(self) -> bool:
        """This epoch tries (or confirms) the mode that is not the incumbent."""
        return self._exploring

    def kept_changed(self) -> bool:
        """True once each time the kept mode changes, counted from when both modes were
        measured and never during an exploration: the caller's cue to log the choice."""
        if len(self.rate) < 2 or self._exploring or self._reported == self.incumbent:
            return False
        self._reported = self.incumbent
        return True

    def seeded(self) -> EpochSwitch:
        """A switch for another level of load that starts from this one's rates, mode and pace
        of exploring (so it does not begin by running the worse mode for an epoch)."""
        return type(self)(epoch_s=self.epoch_s, min_rounds=self.min_rounds, weight=self.weight,
                          first_explore=self.first_explore, max_explore=self.max_explore,
                          wide_margin=self.wide_margin, far_margin=self.far_margin,
                          max_far=self.max_far,
                          cut_below=self.cut_below, cut_early=self.cut_early,
                          on=self.incumbent,
                          patient=True, rate=dict(self.rate), steal=self.steal,
                          _every=self._every)

    def mode(self, now: float) -> bool:
        """The mode of a unit of work starting ``now``. An epoch interrupted for longer
        than an epoch (the load moved elsewhere) starts again."""
        if self._start is None or now - self._last > self.epoch_s:
            self._begin(now)
        elif ((now - self._start >= self.epoch_s and self._rounds >= self.min_rounds)
              or self._losing(now)):
            self._end_epoch()
            self._begin(now)
        self._last = now
        return self.on

    def _losing(self, now: float) -> bool:
        """Whether an explored epoch (not a confirming one) has run ``min_rounds`` units and
        half an epoch below ``cut_below`` of the incumbent's rate, or a quarter below
        ``cut_early``: it has lost by a wide margin, and the rest would only cost more. On
        the demo pair at 8 streams a load level's drafting epochs ran at 0.5-0.6 of its plain
        ones (docs/performance.md)."""
        if not self._exploring or self._confirming or self.incumbent not in self.rate:
            return False
        if self._rounds < self.min_rounds:
            return False
        ran, rate = now - self._start, self.rate[self.incumbent] * self._busy_s
        return ((ran >= self.epoch_s / 2 and self._tokens < self.cut_below * rate)
                or (ran >= self.epoch_s / 4 and self._tokens < self.cut_early * rate))

    def observe(self, started: float, cycle_s: float, tokens: int, cut: bool = False) -> None:
        """A unit of work (a round, a pass) that began at ``started``, took ``cycle_s`` to
        the next one and yielded ``tokens``; ``cut``: not representative of its mode (a round
        without drafts cut short by the drafts of others in its step), not counted."""
        if self._start is None or started < self._start or cycle_s <= 0 or cut:
            return
        self._tokens += tokens
        self._busy_s += cycle_s
        self._rounds += 1

    def _begin(self, now: float) -> None:
        self._start, self._tokens, self._busy_s, self._rounds = now, 0, 0.0, 0
        self._stolen_at = self.steal() if self.steal is not None else None

    def _epoch_rate(self) -> float:
        """The epoch's tokens per second of cycles, as if nothing had been stolen."""
        rate = self._tokens / self._busy_s
        if self.steal is None:
            return rate
        return rate / stolen.net(self._stolen_at, self.steal())

    def _end_epoch(self) -> None:
        mode, rate = self.on, self._epoch_rate()
        old = self.rate.get(mode)
        # A mode's average runs over its consecutive epochs only: a rate from before the other
        # mode's epochs is stale (rates drift as contexts grow), so an explored mode is judged
        # by its own epoch against the incumbent's latest average
        # (a confirming epoch averages with the explored one before it)
        self.rate[mode] = (rate if old is None or (self._exploring and not self._confirming)
                           else (1 - self.weight) * old + self.weight * rate)
        if (not mode) not in self.rate and not self.patient:
            self._exploring, self.on = True, not mode  # the other mode never measured: now
            return
        if old is None and len(self.rate) == 2 and not self.patient:
            self._exploring, self.on = False, self._on_wins()  # both measured: the better begins
            return
        if self._exploring:
            best = self._on_wins()
            if best != self.incumbent and not self._confirming:
                # It won one epoch: one more of it confirms before it is kept, so that one
                # epoch's luck (a cell's start, a burst on the other cores) does not hand it
                # the next ``first_explore`` epochs
                self._confirming = True
                return
            self._confirming = False
            # A mode that lost by a wide margin is tried again later than one that nearly won,
            # one that lost by a far margin later still (a closer loss brings it back nearer)
            low, high = min(self.rate.values()), max(self.rate.values())
            wide, far = low < self.wide_margin * high, low < self.far_margin * high
            cap = self.max_far if far else self.max_explore
            self._every = (min(cap, (4 if wide else 2) * self._every)
                           if best == self.incumbent else self.first_explore)
            self._exploring, self._streak, self.on = False, 0, best
            return
        # Between explorations the incumbent stays: the other mode's rate is as old as its last
        # epoch, and weighing the incumbent's drifting rate against it switched on the drift
        self._streak += 1
        if self._streak >= self._every:
            self._exploring, self._streak, self.on = True, 0, not mode

    def _on_wins(self) -> bool:
        return self.rate[True] > self.rate[False]
