"""How many torch threads a verifier's passes without drafts run on (``--plain-threads``).

A pass that verifies no drafts (target-only rounds, and every round while drafts do not pay
under load) has no drafter working beside it: the cores a drafter would use are free. On
more threads such a pass is shorter (demo target, 8 to 16 sessions × 1 token: about 25%
on two threads against one, docs/performance.md), but whether the mesh then serves more
depends on the machine: the extra thread competes with the gateway, Redis and any other
process for the same cores, and on some machines two threads were slower even alone.

So the verifier measures. Its plain passes run in epochs on ``narrow`` threads (the
process's own) or ``wide`` ones (services/epoch_switch.py), one switch per level of batch
size (1, 2-3, 4-7, 8-15, ... sessions a pass), and each epoch's rate is the session-tokens
of its passes over their cycles, from one plain pass's start to the next one's: the time the
rest of the mesh took between them counts. The faster mode is kept, the
other tried again now and then; the wide one only when it serves at least MIN_GAIN times
what the narrow one does (it costs more CPU). A pass that verifies
drafts, or feeds a prompt, runs as before and breaks the chain of cycles.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from services.epoch_switch import EpochSwitch

log = logging.getLogger(__name__)

# More threads cost a pass nearly their count in CPU for a fraction of it in time: they are
# kept only when they serve this much more.
MIN_GAIN = 1.1


class PlainThreads:
    # Epochs of at least 1 s and 16 passes: with 0.5 s and 8, the rates of 16-session epochs
    # swung by up to a fifth both ways and the choice flipped within seconds, so the mesh ran
    # mostly on the thread count that serves less (docs/architecture.md, "Plain threads")
    def __init__(self, narrow: int, wide: int, epoch_s: float = 1.0,
                 min_passes: int = 16,
                 steal: Callable[[], tuple[int, int] | None] | None = None) -> None:
        if wide <= narrow:
            raise ValueError(f"plain threads ({wide}) must be more than the process's "
                             f"threads ({narrow})")
        self.narrow, self.wide = narrow, wide
        self._epoch_s, self._min_passes = epoch_s, min_passes
        self._steal = steal  # services/steal.py ``read``: epochs' rates net of steal
        # one switch per batch size level: a pass's rate depends on how many sessions it carries
        self.switches: dict[int, EpochSwitch] = {}
        self._previous: tuple[float, int] | None = None  # the last plain pass: start, rows
        self.passes = {narrow: 0, wide: 0}  # plain passes run on each

    @staticmethod
    def level(rows: int) -> int:
        """The batch size level of a pass of ``rows`` sessions: 1, 2-3, 4-7, 8-15, ... are
        levels 1, 2, 3, 4, ..."""
        return max(1, rows).bit_length()

    def switch(self, rows: int) -> EpochSwitch:
        """The switch of passes of ``rows`` sessions."""
        level = self.level(rows)
        found = self.switches.get(level)
        if found is None:
            found = self.switches[level] = EpochSwitch(
                epoch_s=self._epoch_s, min_rounds=self._min_passes, on_margin=MIN_GAIN,
                steal=self._steal)
        return found

    def kept(self, level: int) -> int:
        """The threads kept between explorations for passes of batch size ``level``."""
        switch = self.switches.get(level)
        return self.wide if switch is not None and switch.incumbent else self.narrow

    def plain(self, now: float, rows: int) -> int:
        """Threads for a pass without drafts of ``rows`` sessions starting ``now``."""
        if self._previous is not None:
            started, n = self._previous
            self.switch(n).observe(started, now - started, n)
        switch = self.switch(rows)
        threads = self.wide if switch.mode(now) else self.narrow
        self._previous = (now, rows)
        if switch.kept_changed():
            self._log_kept(self.level(rows), switch)
        self.passes[threads] += 1
        return threads

    def other(self) -> None:
        """A pass that verifies drafts or feeds a prompt runs: the next plain pass's cycle
        does not continue the last one's."""
        self._previous = None

    def _log_kept(self, level: int, switch: EpochSwitch) -> None:
        low = 1 << (level - 1)
        log.info("passes without drafts of %d-%d sessions now run on %d torch threads "
                 "(session-tokens per second: %.0f on %d, %.0f on %d)", low, 2 * low - 1,
                 self.kept(level), switch.rate[True], self.wide, switch.rate[False],
                 self.narrow)
