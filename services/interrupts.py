"""Interrupts that never land between starting a child process and recording it.

A signal handler that raises (Python's own Ctrl-C handler does) can raise inside
``subprocess.Popen`` after the child was forked: the child runs on, and nobody knows its pid.
``interrupting(signum)`` is a handler that raises ``KeyboardInterrupt`` like Ctrl-C, except
inside a ``deferred()`` block (local_mesh wraps each spawn and its bookkeeping in one), where it
is held and raised when the outermost block ends. Signal handlers run on the main thread, so the
module's counters need no lock.

A handler's exception can also be lost: a signal that arrives while the main thread runs a
finalizer (an object's ``__del__`` or a weakref callback, which the interpreter runs at
whatever allocation frees the object: gRPC's call objects have them) raises inside it, where
the interpreter prints "Exception ignored" and drops it. `specmesh load` then ran its streams
on after a SIGTERM. So each raise stays ``pending`` until whoever handles the interrupt says
so (``handled``), and loops that wait on the main thread call ``raise_pending``, which raises
it again (``join`` waits for a thread that way).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_depth = 0
_held: list[int] = []
_pending: list[int] = []  # signals raised as KeyboardInterrupt that nobody handled yet


@contextmanager
def deferred() -> Iterator[None]:
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
    if _depth == 0 and _held:  # not reached when the block raised: that exception goes on
        _pending.extend(_held)
        _held.clear()
        raise KeyboardInterrupt


def interrupting(signum: int, frame) -> None:
    """Signal handler: KeyboardInterrupt now, or at the end of the current deferred() block."""
    if _depth:
        _held.append(signum)
        return
    _pending.append(signum)
    raise KeyboardInterrupt


def raise_pending() -> None:
    """Raises KeyboardInterrupt again for a signal whose first one was lost (raised inside a
    finalizer); nothing when there is none. For loops that wait on the main thread."""
    if _pending:
        raise KeyboardInterrupt


def handled() -> None:
    """The interrupt was caught where it counts: ``raise_pending`` raises it no more."""
    _pending.clear()


def join(thread: threading.Thread, poll_s: float = 0.25) -> None:
    """``thread.join()`` on the main thread, raising a pending interrupt (``raise_pending``)
    at least every ``poll_s``; it returns as soon as the thread ends."""
    while thread.is_alive():
        thread.join(poll_s)
        raise_pending()
