"""The local mesh of a client command (`specmesh bench`, `specmesh load`): started on demand,
stopped when the command ends however it ends. Ctrl-C, and SIGTERM alike, inside the block
print "interrupted", stop every process already started (and the mesh's temporary folder) and
exit 130."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import typer

from services import interrupts
from services.interrupts import interrupting
from services.local_mesh import Mesh, MeshSpec, start_mesh


@contextmanager
def command_mesh(err) -> Iterator[Callable[[MeshSpec], Mesh]]:
    """Yields ``start(spec)``, which starts a local mesh and prints where its logs are (on
    ``err``, a rich Console); every mesh started is stopped when the block ends. Ctrl-C or
    SIGTERM inside the block prints "interrupted" and exits 130."""
    meshes: list[Mesh] = []

    def start(spec: MeshSpec) -> Mesh:
        with err.status("starting a local mesh"):
            mesh = start_mesh(spec, into=meshes)
        logs = spec.log_dir or "a temporary folder, removed on exit"
        err.print(f"local mesh at {mesh.gateway_address} (logs: {logs})")
        return mesh

    # Ctrl-C and SIGTERM raise KeyboardInterrupt, but never between starting a process and
    # recording it (services/interrupts.py).
    previous = {sig: signal.signal(sig, interrupting) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield start
    except KeyboardInterrupt:
        interrupts.handled()
        err.print("interrupted")
        raise typer.Exit(130) from None
    finally:
        # A second Ctrl-C or SIGTERM must not cut the clean-up short.
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
        try:
            for mesh in meshes:
                mesh.stop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
