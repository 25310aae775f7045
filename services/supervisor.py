"""`specmesh up` as a supervisor: SIGINT and SIGTERM stop the mesh whatever phase it is in.

``StopSignals`` takes both signals over from the moment it is entered. While nothing has been
started (``raising``, the first phase), a signal raises ``Stopped`` at once. Once child
processes exist, a signal only sets ``event``: the code that starts and watches them polls
it (``start_mesh(cancel=...)``, ``watch``), so no exception lands between starting a process
and recording it, and a second signal never interrupts the stopping. Leaving the block puts
the previous handlers back.
"""

from __future__ import annotations

import signal
import sys
import threading

from services.local_mesh import Mesh

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(Exception):
    """A stop signal arrived before anything was started."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum = 0
        self.raising = True
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame) -> None:
        if self.event.is_set():
            return  # already stopping: a second Ctrl-C must not cut the clean-up short
        self.signum = signum
        self.event.set()
        if self.raising:
            raise Stopped(signum)

    def __enter__(self) -> StopSignals:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by this signal: 130 for SIGINT, 143 for
        SIGTERM."""
        return 128 + self.signum


def watch(mesh: Mesh, stop: threading.Event, period_s: float = 0.5) -> int:
    """Blocks until ``stop`` is set (0) or one of the mesh's processes exits (1, with the
    name of the process and the end of its log on stderr). Does not stop the mesh."""
    while not stop.wait(period_s):
        dead = [p for p in mesh.procs if p.popen.poll() is not None]
        if dead:
            proc = dead[0]
            tail = proc.log_path.read_text(errors="replace")[-2000:] \
                if proc.log_path.exists() else ""
            print(f"{proc.name} exited with code {proc.popen.returncode}; the end of its "
                  f"log:\n{tail}\nStopping the mesh.", file=sys.stderr)
            return 1
    return 0
