"""Two modes of running the same work, compared side by side: in an exploring epoch the
modes are interleaved unit by unit, so that both are measured under the same conditions.

The epoch switch (services/epoch_switch.py) measures one mode per epoch and compares an
epoch with the one before. Where the machine's own speed moves between epochs, that
comparison measures the machine: on a 2-core AMD EPYC VM (AVX2) a verifier's 8-session
passes took 5.9 ms in one run and 10.4 ms in another minutes apart (the same code), and its
plain-thread switch, comparing 1-second epochs of one and of two threads at 16
streams, took two threads at 1.26x and 1.24x of one thread's rate and measured them at 1.01x
and 1.07x at the next comparisons (docs/performance.md, 2026-11-28).

Here an exploring epoch interleaves the modes unit by unit (a verifier's passes) and rates
each mode by the tokens of its units over their cycle times (from a unit's start to the
next one's): both modes' units lie within milliseconds of each other, so a change in the
machine's speed weighs on both alike. The order is the Thue-Morse sequence (unit n of the
epoch takes the mode on when n has an even number of 1 bits), not strict turns: a
verifier's passes come in chains (a plain round's 8 passes back to back, then a gap while
the answers travel and the next calls arrive), and strict turns gave every gap to the
chain's last pass, always the same mode: in a simulation of chains of 8 units of 10 ms with
a gap of 8 ms after each, two equal modes measured 1.19x apart (40 ms gaps: 1.94x). The
Thue-Morse order gives each mode half of any aligned run of 2^k units and of every 8th
unit; units drawn at random were as unbiased but spread the ratio by 5% (one-second epochs)
where the chains are regular. Where switching costs nothing between units (the threads of
the next pass) that is a paired comparison for the price of half an epoch in the worse
mode. Between explorations the kept mode runs; the next exploration comes after
``first_explore`` epochs, doubling while the kept mode keeps winning, up to ``max_explore``.
The first epoch explores. A tie goes to the mode that is off, the cheaper one; with
``on_margin`` above 1 the mode that is on is taken only when it serves that factor more, and
once kept it stays until the mode that is off serves more (a band against noise).

With ``recheck`` the kept mode is measured between explorations too, and an epoch in which it
serves less than the other mode served at the last exploration calls the next exploration at
once: the work changed under the switch. A verifier's local drafts, kept at one stream on
short prompts (drafting 878 against 544 tokens/s), went on drafting through a bench's
long-prompt cells, where the drafts were accepted a third as often, for 0.84x target-only:
by then explorations came every 16 epochs, after the cells had ended (docs/performance.md,
2026-11-29).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PairedSwitch:
    epoch_s: float = 1.0
    min_rounds: int = 16  # units of an epoch; an exploring one's of each mode: half of them
    first_explore: int = 2  # epochs of the kept mode before the next exploration
    max_explore: int = 16  # ... doubling while the kept mode keeps winning, up to this
    on_margin: float = 1.0  # the mode that is on must serve this factor more to be taken
    cut_below: float = 0.0  # an exploration whose mode that is on serves less than this share
    #                         of the other's after a quarter of an epoch ends there (0: never)
    recheck: bool = False  # an epoch of the kept mode serving less than the other mode's
    #                         last rate calls the next exploration at once
    rate: dict[bool, float] = field(default_factory=dict)  # per mode: the last exploration's
    _kept: bool = False  # the mode run between explorations
    _exploring: bool = True  # this epoch interleaves the modes
    _reported: bool | None = None  # the kept mode ``kept_changed`` last reported
    _every: int = field(init=False)  # epochs of the kept mode before the next exploration
    _streak: int = 0
    _start: float | None = None
    _last: float = 0.0
    _units: int = 0
    _issued: tuple[float, bool] | None = None  # the last unit's start and mode
    _tokens: dict[bool, float] = field(default_factory=lambda: {True: 0.0, False: 0.0})
    _busy_s: dict[bool, float] = field(default_factory=lambda: {True: 0.0, False: 0.0})
    _count: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})

    def __post_init__(self) -> None:
        self._every = self.first_explore

    @classmethod
    def keeping(cls, mode: bool, **settings) -> PairedSwitch:
        """A switch that starts keeping ``mode`` without exploring, its first exploration
        after ``max_explore`` epochs (a mode known from elsewhere: services/local_drafts.py
        seeds a level from the levels around it)."""
        switch = cls(_kept=mode, _exploring=False, **settings)
        switch._every = switch.max_explore
        return switch

    @property
    def exploring(self) -> bool:
        """Whether the current epoch interleaves the modes."""
        return self._exploring

    @property
    def incumbent(self) -> bool:
        """The mode kept between explorations."""
        return self._kept

    def kept_changed(self) -> bool:
        """True once each time the kept mode changes, counted from the first exploration's
        end: the caller's cue to log the choice."""
        if not self.rate or self._reported == self._kept:
            return False
        self._reported = self._kept
        return True

    def mode(self, now: float) -> bool:
        """The mode of a unit of work starting ``now``. An epoch interrupted for longer than
        an epoch (the load moved elsewhere) starts again."""
        if self._start is None or now - self._last > self.epoch_s:
            self._begin(now)
        elif now - self._start >= self.epoch_s and self._enough():
            self._end_epoch()
            self._begin(now)
        elif self._losing(now):
            confirms = not self._kept  # (the mode that is on was not kept before either)
            self._end_epoch()
            if confirms:  # it lost again, widely: the next exploration comes as late as any
                self._every = self.max_explore
            self._begin(now)
        self._last = now
        # (the Thue-Morse order: each mode half of every aligned run of 2^k units)
        mode = self._kept if not self._exploring else self._units.bit_count() % 2 == 0
        self._issued = (now, mode)
        self._units += 1
        return mode

    def observe(self, started: float, cycle_s: float, tokens: int, cut: bool = False) -> None:
        """The unit that began at ``started`` (the last one ``mode`` gave) took ``cycle_s`` to
        the next one and yielded ``tokens``; ``cut``: not representative, not counted."""
        # (``_begin`` forgets the last unit: one given in an earlier epoch is not counted)
        if (not (self._exploring or self.recheck) or self._issued is None
                or self._issued[0] != started or cycle_s <= 0 or cut):
            return
        mode = self._issued[1]
        self._tokens[mode] += tokens
        self._busy_s[mode] += cycle_s
        self._count[mode] += 1

    def _losing(self, now: float) -> bool:
        """Whether an exploration has run a quarter of an epoch and the units of each mode an
        epoch needs with the mode that is on serving less than ``cut_below`` of the other's:
        it lost by a wide margin, and the rest of the epoch would only cost more (a
        verifier's local drafts at 16 streams served about half as much:
        verifier_svc/local_drafts.py). The next exploration then comes after
        ``max_explore`` epochs where the mode that is off was kept before it (the loss
        confirms it), and after ``first_explore`` where the mode that is on was: a quarter
        epoch is a few units of each mode, and one such read, 217 against 311 tokens/s for
        a verifier's local drafts at one stream where the exploration before had read 652
        against 378, kept drafting off for the rest of a bench's one-stream cells
        (docs/performance.md, 2026-11-29)."""
        if not self._exploring or not self.cut_below or now - self._start < self.epoch_s / 4:
            return False
        if not self._enough():
            return False
        on, off = (self._tokens[m] / self._busy_s[m] if self._busy_s[m] else 0.0
                   for m in (True, False))
        return on < self.cut_below * off

    def _enough(self) -> bool:
        if self._exploring:
            return min(self._count.values()) >= max(1, self.min_rounds // 2)
        return self._units >= self.min_rounds

    def _kept_fell(self) -> bool:
        """``recheck``: this epoch of the kept mode served less than the other mode did at the
        last exploration."""
        kept = self._kept
        if not self.recheck or not self.rate or not self._busy_s[kept]:
            return False
        return self._tokens[kept] / self._busy_s[kept] < self.rate[not kept]

    def _begin(self, now: float) -> None:
        self._start, self._units, self._issued = now, 0, None
        for mode in (True, False):
            self._tokens[mode], self._busy_s[mode], self._count[mode] = 0.0, 0.0, 0

    def _end_epoch(self) -> None:
        if not self._exploring:
            self._streak += 1
            if self._streak >= self._every or self._kept_fell():
                self._exploring, self._streak = True, 0
            return
        measured = bool(self.rate)  # (an exploration before this one compared the modes)
        self.rate = {mode: self._tokens[mode] / self._busy_s[mode] for mode in (True, False)}
        taking = not (measured and self._kept)
        best = self.rate[True] > (self.on_margin if taking else 1.0) * self.rate[False]
        self._every = (min(self.max_explore, 2 * self._every)
                       if measured and best == self._kept else self.first_explore)
        self._kept, self._exploring = best, False
