"""Interrupts that never land between starting a child process and recording it.

A signal handler that raises (Python's own Ctrl-C handler does) can raise inside
``subprocess.Popen`` after the child was forked: the child runs on, and nobody knows its pid.
``interrupting(signum)`` is a handler that raises ``KeyboardInterrupt`` like Ctrl-C, except
inside a ``deferred()`` block (local_mesh wraps each spawn and its bookkeeping in one), where it
is held and raised when the outermost block ends. Signal handlers run on the main thread, so the
module's counters need no lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_depth = 0
_held: list[int] = []


@contextmanager
def deferred() -> Iterator[None]:
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
    if _depth == 0 and _held:  # not reached when the block raised: that exception goes on
        _held.clear()
        raise KeyboardInterrupt


def interrupting(signum: int, frame) -> None:
    """Signal handler: KeyboardInterrupt now, or at the end of the current deferred() block."""
    if _depth:
        _held.append(signum)
        return
    raise KeyboardInterrupt
