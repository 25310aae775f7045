"""Ctrl-C and SIGTERM in the client commands (services/interrupts.py): a KeyboardInterrupt that
a finalizer swallowed is raised again by the loops that wait, until it is handled."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from services import interrupts
from services.local_mesh import free_port
from specmesh.bench_workers import run_workers
from specmesh.loadtest import LoadOptions, run_streams


class _SignalledWhileFinalized:
    """An object whose finalizer is running when the signal's handler runs (as a gRPC call
    object's can be, freed by whatever allocation the main thread makes)."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGUSR2)
        for _ in range(1000):  # the handler runs at the next check of the eval loop: in here
            pass


@pytest.fixture
def handler(monkeypatch):
    """The handler on SIGUSR2; yields the exceptions the interpreter dropped ("Exception
    ignored in ..."), by their types."""
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_type))
    previous = signal.signal(signal.SIGUSR2, interrupts.interrupting)
    yield dropped
    signal.signal(signal.SIGUSR2, previous)
    interrupts.handled()


def test_an_interrupt_a_finalizer_swallowed_is_raised_again_until_handled(handler):
    obj = _SignalledWhileFinalized()
    del obj  # the KeyboardInterrupt is raised inside __del__, and dropped
    assert handler == [KeyboardInterrupt]
    with pytest.raises(KeyboardInterrupt):
        interrupts.raise_pending()
    with pytest.raises(KeyboardInterrupt):  # still: nobody said it was handled
        interrupts.raise_pending()
    interrupts.handled()
    interrupts.raise_pending()  # nothing pending now


def test_no_interrupt_is_pending_without_a_signal():
    interrupts.raise_pending()


def test_the_load_loop_stops_on_an_interrupt_that_was_swallowed(handler):
    """`specmesh load` ran its streams on after a SIGTERM whose KeyboardInterrupt a finalizer
    took (a test saw it, under load): its waiting loop now raises it within a quarter second.
    The streams here call a port nobody listens on; they would go on for a minute."""
    obj = _SignalledWhileFinalized()
    del obj
    assert handler == [KeyboardInterrupt]
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_streams(f"127.0.0.1:{free_port()}", LoadOptions(streams=1, timeout_s=5),
                    duration_s=60)
    assert time.monotonic() - start < 10


def test_a_bench_cell_stops_on_an_interrupt_that_was_swallowed(handler):
    """The same for `specmesh bench`: its cell waits for its workers through
    ``interrupts.join``; this cell's one request would take a minute."""
    obj = _SignalledWhileFinalized()
    del obj
    assert handler == [KeyboardInterrupt]
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_workers(1, 1, lambda conn, j: time.sleep(60) or {"prompt_index": j})
    assert time.monotonic() - start < 10
