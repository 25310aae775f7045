"""Whether a loaded gateway's requests draft at all, decided for all of them together.

With several requests in flight their rounds share the replicas' passes (step batching):
a request that stops drafting still waits for passes that carry the others' drafts, so
its own round times do not show what not drafting would cost, and a choice made per
request keeps drafting after drafting stopped paying. Measured on the demo pair behind an
800-token shared context at 8 streams (drafter acceptance 0.16): a request's round took
about 52 ms with drafts and about 52 ms without while the others drafted (the gateway's
cycle averages), against 31 ms in the target-only run beside it (253.8 tokens/s over 8
streams); the per-request choice kept drafting, at 0.71x of target-only.

What decides is the throughput of all the requests together in each mode. The switch runs
the gateway's requests of one drafter kind at one load level in epochs of one mode (at
least ``epoch_s`` and ``min_rounds`` rounds), and measures each epoch's tokens per
request-second: the tokens of the rounds that began in it over those rounds' cycle times.
A round that began in the previous mode does not count, nor does a round without drafts that
was cut to one token because its step also verified drafts (or fed a prompt): after a
drafting epoch the first plain rounds run beside the others' last drafted ones, and on the
demo pair at 8 streams about one round in five of the first plain epoch was cut, which put
that epoch at 0.85 of what the plain epochs after it measured, and drafting, 0.85 of plain in
its steady epochs, kept winning. It keeps the better mode and
tries the other one again after 2 epochs, then 4, 8 and 16 while the incumbent keeps
winning (2, 8, 16 when the other mode reached less than 0.8 of its rate): with a 1.5x
difference, 1 epoch in 17 costs about 2%. A tie goes to not drafting.
A load level seen for the first time starts from the nearest level's rates, mode and pace
of exploring; the first level of all from what lone requests measured (draft_length.py), so
that a gateway whose drafts did not pay for one request does not begin its first loaded
epochs drafting. A switch whose first mode came from such evidence (``patient``) measures
the other mode on the usual schedule, after ``first_explore`` epochs, not at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoadSwitch:
    epoch_s: float = 0.5
    min_rounds: int = 8
    weight: float = 0.5  # of an epoch's rate in its mode's running average
    first_explore: int = 2  # epochs of the incumbent before the other mode is tried again
    max_explore: int = 16  # ... doubling while the incumbent keeps winning, up to this
    wide_margin: float = 0.8  # (quadrupling while the other mode's rate is below this share)
    speculate: bool = True  # the mode of the current epoch
    patient: bool = False  # the first mode came from evidence: explore on schedule
    rate: dict[bool, float] = field(default_factory=dict)  # tokens per request-second
    _exploring: bool = False  # this epoch tries the mode that is not the incumbent
    _every: int = 0
    _streak: int = 0
    _start: float | None = None
    _last: float = 0.0
    _tokens: int = 0
    _busy_s: float = 0.0
    _rounds: int = 0

    def __post_init__(self) -> None:
        self._every = self._every or self.first_explore

    @property
    def incumbent(self) -> bool:
        """The mode kept between explorations."""
        return self.speculate != self._exploring

    def seeded(self) -> LoadSwitch:
        """A switch for another load level that starts from this one's rates, mode and pace
        of exploring (so it does not begin by running the worse mode for an epoch)."""
        best = self.rate[True] > self.rate[False] if len(self.rate) == 2 else self.incumbent
        return LoadSwitch(epoch_s=self.epoch_s, min_rounds=self.min_rounds, weight=self.weight,
                          first_explore=self.first_explore, max_explore=self.max_explore,
                          wide_margin=self.wide_margin, speculate=best, patient=True,
                          rate=dict(self.rate), _every=self._every)

    def mode(self, now: float) -> bool:
        """Whether a round starting ``now`` drafts. An epoch interrupted for longer than
        an epoch (the load moved to another level) starts again."""
        if self._start is None or now - self._last > self.epoch_s:
            self._begin(now)
        elif now - self._start >= self.epoch_s and self._rounds >= self.min_rounds:
            self._end_epoch()
            self._begin(now)
        self._last = now
        return self.speculate

    def observe(self, started: float, cycle_s: float, tokens: int, cut: bool = False) -> None:
        """A round that began at ``started``, took ``cycle_s`` to the request's next round
        and yielded ``tokens``; ``cut``: a round without drafts cut short by the drafts of
        others in its step (RoundResult.cut), not counted."""
        if self._start is None or started < self._start or cycle_s <= 0 or cut:
            return
        self._tokens += tokens
        self._busy_s += cycle_s
        self._rounds += 1

    def _begin(self, now: float) -> None:
        self._start, self._tokens, self._busy_s, self._rounds = now, 0, 0.0, 0

    def _end_epoch(self) -> None:
        mode, rate = self.speculate, self._tokens / self._busy_s
        old = self.rate.get(mode)
        self.rate[mode] = rate if old is None else (1 - self.weight) * old + self.weight * rate
        if (not mode) not in self.rate:
            if not self.patient:  # the other mode was never measured: now
                self._exploring, self.speculate = True, not mode
                return
            best = mode  # (evidence chose it: the other is measured on schedule)
        else:
            best = self.rate[True] > self.rate[False]
            if old is None and not self.patient:  # both measured once: the better begins
                self._exploring, self.speculate = False, best
                return
        if self._exploring:
            # A mode that lost by a wide margin is tried again later than one that nearly won
            wide = min(self.rate.values()) < self.wide_margin * max(self.rate.values())
            self._every = (min(self.max_explore, (4 if wide else 2) * self._every)
                           if best == self.incumbent else self.first_explore)
            self._exploring, self._streak, self.speculate = False, 0, best
            return
        self._streak += 1
        if self._streak >= self._every:
            self._exploring, self._streak = True, 0
            self.speculate = not best
        else:
            self.speculate = best
