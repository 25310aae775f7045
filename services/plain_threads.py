"""How many torch threads a verifier's decode passes run on (``--plain-threads``).

A pass that verifies no drafts (target-only rounds, and every round while drafts do not pay
under load) has no drafter working beside it: the cores a drafter would use are free. On
more threads such a pass is shorter (demo target, 8 to 16 sessions × 1 token: about 25%
on two threads against one, docs/performance.md), but whether the mesh then serves more
depends on the machine: the extra thread competes with the gateway, Redis and any other
process for the same cores, and on some machines two threads were slower even alone.

So the verifier measures, one switch per level of batch size (1, 2-3, 4-7, 8-15, ...
sessions a pass). Now and then an epoch's passes interleave ``narrow`` threads (the
process's own) and ``wide`` ones (services/paired_switch.py), and each count's rate is
the session-tokens of its passes over their cycles, from a pass's start to the next one's:
the time the rest of the mesh took between them counts. Between such epochs the
faster count runs; the wide one is taken only when it serves at least MIN_GAIN times what
the narrow one does (it costs more CPU), and kept until the narrow one serves more.
Measured side by side, the two counts see the same machine: epochs of one count against
epochs of the other (services/epoch_switch.py, used here before) measured a VM's swings
and a bench cell's drift as much as the threads (docs/performance.md, 2026-11-28).

Passes that verify drafts have switches of their own, rated in session-rounds (a round's
tokens do not depend on the threads), unless a drafter drafts beside them: a call whose
gateway drafts the session's next round meanwhile (its speculation tree) says so
(``VerifyCall.beside``), and its pass runs on the process's threads, the drafter's core
being busy. Without a tree beside, the drafter's core is free for the verify: on a target
of ~240M parameters with the demo drafter, a 4-token verify took 16.7 ms on two threads
against 29.1 on one (in process), and in the mesh rounds ran 43 a second against 31
(docs/performance.md, 2026-11-28); whether the gateway drafts trees it measures itself (gateway/tree_width.py
``TreeSwitch``). A pass of the other kind, one beside a tree or one that feeds a prompt
breaks the chain of cycles.
"""

from __future__ import annotations

import logging

from services.paired_switch import PairedSwitch

log = logging.getLogger(__name__)

# More threads cost a pass nearly their count in CPU for a fraction of it in time: they are
# taken only when they serve this much more (and kept while they serve more at all).
MIN_GAIN = 1.1


class PlainThreads:
    # Epochs of at least 1 s and 16 passes (an exploring one's: 8 of each count)
    def __init__(self, narrow: int, wide: int, epoch_s: float = 1.0,
                 min_passes: int = 16) -> None:
        if wide <= narrow:
            raise ValueError(f"plain threads ({wide}) must be more than the process's "
                             f"threads ({narrow})")
        self.narrow, self.wide = narrow, wide
        self._epoch_s, self._min_passes = epoch_s, min_passes
        # one switch per batch size level: a pass's rate depends on how many sessions it carries
        self.switches: dict[int, PairedSwitch] = {}
        # passes that verify drafts: switches of their own (the drafter works beside them)
        self.draft_switches: dict[int, PairedSwitch] = {}
        # the last pass of the chain: start, rows, whether it verified drafts
        self._previous: tuple[float, int, bool] | None = None
        self.passes = {narrow: 0, wide: 0}  # plain passes run on each
        self.draft_passes = {narrow: 0, wide: 0}  # passes with drafts run on each

    @staticmethod
    def level(rows: int) -> int:
        """The batch size level of a pass of ``rows`` sessions: 1, 2-3, 4-7, 8-15, ... are
        levels 1, 2, 3, 4, ..."""
        return max(1, rows).bit_length()

    def switch(self, rows: int, drafts: bool = False) -> PairedSwitch:
        """The switch of passes of ``rows`` sessions (``drafts``: passes that verify
        drafts)."""
        level = self.level(rows)
        switches = self.draft_switches if drafts else self.switches
        found = switches.get(level)
        if found is None:
            found = switches[level] = PairedSwitch(
                epoch_s=self._epoch_s, min_rounds=self._min_passes, on_margin=MIN_GAIN)
        return found

    def kept(self, level: int, drafts: bool = False) -> int:
        """The threads kept between explorations for passes of batch size ``level``."""
        switch = (self.draft_switches if drafts else self.switches).get(level)
        return self.wide if switch is not None and switch.incumbent else self.narrow

    def plain(self, now: float, rows: int, drafts: bool = False) -> int:
        """Threads for a pass of ``rows`` sessions starting ``now``, without drafts or
        (``drafts``) verifying drafts. A cycle runs from one pass's start to the next's of
        the same kind; a pass of the other kind ends the chain."""
        if self._previous is not None and self._previous[2] == drafts:
            started, n, _ = self._previous
            self.switch(n, drafts).observe(started, now - started, n)
        switch = self.switch(rows, drafts)
        threads = self.wide if switch.mode(now) else self.narrow
        self._previous = (now, rows, drafts)
        if switch.kept_changed():
            self._log_kept(self.level(rows), switch, drafts)
        (self.draft_passes if drafts else self.passes)[threads] += 1
        return threads

    def other(self) -> None:
        """A pass that verifies drafts or feeds a prompt runs: the next plain pass's cycle
        does not continue the last one's."""
        self._previous = None

    def _log_kept(self, level: int, switch: PairedSwitch, drafts: bool) -> None:
        low = 1 << (level - 1)
        log.info("passes %s drafts of %d-%d sessions now run on %d torch threads "
                 "(%s per second: %.0f on %d, %.0f on %d)", "with" if drafts else "without",
                 low, 2 * low - 1, self.kept(level, drafts),
                 "session-rounds" if drafts else "session-tokens", switch.rate[True],
                 self.wide, switch.rate[False], self.narrow)
