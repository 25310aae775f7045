"""How wide the speculation cache's tree is: as wide as ends by the time the verify does.

While the verifier checks round r's drafts, the drafter drafts round r+1 for the likely
outcomes of that verify (gateway/rounds.py, drafter_svc/tree.py), and round r+1 starts once
both have answered. A tree that is still drafting when the verify returns delays the round
by the difference; a tree that ends before it costs the round nothing. So the widest tree
that fits inside the verify's time is the one to draft: every branch it holds raises the
hit rate for free, and every branch past it delays every round.

What fits depends on the machine: a step of the tree is one drafter pass over its B
branches, which on an AVX2-only CPU costs about twice as much at 16 branches as at 4 while
a verify of 4 tokens does not grow with it. There, fan-out 16 made each drafting round wait
~5 ms for the tree after its verify, and one stream ran 8-13% faster at fan-out 4 than at 16
(docs/performance.md, 2026-11-27); on a Xeon with AVX-512 and AMX, 16 branches ran ~5% ahead
of 4 (2026-11-25).

The width follows what the rounds measure, additive increase and multiplicative decrease:
a round that waited for its tree after the verify shrinks it, one whose tree was ready
widens it by a fraction of a branch, up to ``--spec-fanout``. It never goes below ``floor``
(4): a drafter pass over up to 4 rows costs little more than one over a single row (2.1
against 1.8 ms here: the weights are read once either way; in process, trees of 1, 2 and 4
branches took 7-10 ms alike), so a narrower tree would end no sooner and only hit less often.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.epoch_switch import EpochSwitch

FLOOR = 4  # fewer branches than this end no sooner (see the module docstring)


@dataclass
class TreeWidth:
    """One per gateway: the branches to ask the next speculation call for."""

    most: int  # --spec-fanout
    floor: int = FLOOR
    late_ms: float = 0.5  # a tree that ends this much after its verify delayed the round
    shrink: float = 0.75  # the width after a late tree, per late round
    grow: float = 0.25  # branches added after a tree that ended in time
    width: float = field(init=False)

    def __post_init__(self) -> None:
        if self.most < 1:
            raise ValueError(f"most must be >= 1, got {self.most}")
        self.width = float(self.most)

    @property
    def lowest(self) -> int:
        return min(self.floor, self.most)

    def branches(self) -> int:
        """The fan-out to ask for now."""
        return max(self.lowest, min(self.most, int(self.width)))

    def observe(self, branches: int, waited_ms: float) -> None:
        """A tree of ``branches`` ended ``waited_ms`` after its round's verify returned (0:
        it was ready first). A late tree narrows the next ones; one in time lets them widen
        again, slowly, so that a verify that got slower (a longer context, more drafts) can
        be filled again."""
        if waited_ms > self.late_ms:
            self.width = max(float(self.lowest), min(self.width, branches) * self.shrink)
        elif branches >= self.branches():  # (a narrower tree, asked for earlier, says less)
            self.width = min(float(self.most), self.width + self.grow)


class TreeSwitch(EpochSwitch):
    """Whether lone requests' drafting rounds draft the next round's tree beside the verify
    (``on``), measured as they run (services/epoch_switch.py: epochs of each, tokens per
    second of round cycles, the better kept, the other tried again now and then; a tie goes
    to no tree, the cheaper mode).

    A tree hides the next round's draft behind the verify: on a hit, that round skips the
    draft call. But it keeps the drafter's core busy for the whole verify, and on a CPU that
    core is the one a verifier's pass could take (--plain-threads; the verifier is told,
    VerifyCall.beside, and measures more threads only for passes with no tree beside). Where
    a draft is cheap next to a verify, the core is worth more: on a target of ~240M
    parameters with the demo drafter on a 2-core CPU, k = 3 ran 2.01x target-only without
    trees, the verify on two threads, against 1.46x with them; on the demo pair the two
    ran alike (docs/performance.md, 2026-11-28). Which wins depends on the pair, the
    machine and where the replicas run, so the gateway measures."""
