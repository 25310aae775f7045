"""CPU time a virtual machine's host took from it (steal), for rates measured on a shared host.

On a virtual machine the hypervisor runs other guests on the same physical cores. The time a
vCPU had work to run but was not given the core is counted as steal (``/proc/stat``). A
throughput measured over an interval in which a share ``f`` of the time the CPUs had work
for was stolen is low by about that share: the same work would have run in ``1 - f`` of the
time. On the 2-core VM of docs/performance.md's 2026-11-27 section, consecutive 8-stream
blocks of the same load ran 370-650 tokens/s, the slow ones with 8-22% of the CPUs' time
stolen, and half-second epochs compared under such bursts (services/epoch_switch.py) kept
the worse mode: a verifier's 16-session passes on one thread, at about two thirds of what
two gave.

``read()`` gives (stolen, demanded) CPU time since boot in the kernel's ticks; demanded is
the time the CPUs ran something (user, nice, system, irq, softirq) plus what was stolen.
``share(before, after)`` is the stolen share of the demanded time between two readings.
Idle vCPUs are not counted: an idle core is not slowed by the host. `specmesh bench` reports
it per cell; the gateway's epoch switches divide each epoch's rate by ``1 - share`` (at most
``MAX_SHARE`` of it). A verifier's thread switch compares its two counts within one epoch
(services/paired_switch.py), where steal weighs on both alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

PROC_STAT = Path("/proc/stat")
MAX_SHARE = 0.5  # a rate's correction never more than doubles it


def read(path: Path = PROC_STAT) -> tuple[int, int] | None:
    """(stolen, demanded) ticks over every CPU since boot, or None where the system does not
    count steal (not Linux, or a kernel without the field)."""
    try:
        with path.open() as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    return steal, user + nice + system + irq + softirq + steal


class Clock:
    """``read()`` at most once per ``every_s``, for a caller that asks every round: the
    kernel counts these times in ticks of 1/USER_HZ (10 ms on Linux), so a reading younger
    than that is as good as a new one, and a new one costs an open and read of ``/proc/stat``
    (42 µs on a 2-core EPYC; docs/performance.md). Calling it gives a ``read()`` reading."""

    def __init__(self, source: Callable[[], tuple[int, int] | None] = read,
                 every_s: float = 0.01, now: Callable[[], float] = time.monotonic) -> None:
        self._source, self._every, self._now = source, every_s, now
        self._at = -float("inf")
        self._reading: tuple[int, int] | None = None

    def __call__(self) -> tuple[int, int] | None:
        t = self._now()
        if t - self._at >= self._every:
            self._at, self._reading = t, self._source()
        return self._reading


def net(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float:
    """The share of the interval between two readings that was the machine's own: 1 − the
    stolen share, at least 1 − MAX_SHARE (a rate divided by it at most doubles); 1 without
    readings."""
    return 1.0 - min(MAX_SHARE, share(before, after) or 0.0)


def share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The stolen share of the CPU time demanded between two ``read()`` readings; None
    without readings or demand between them."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return max(0, after[0] - before[0]) / (after[1] - before[1])
