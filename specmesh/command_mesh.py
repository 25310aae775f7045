"""The local mesh of a client command (`specmesh bench`, `specmesh load`): started on demand,
stopped when the command ends however it ends, and Ctrl-C exits 130."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import typer

from services.local_mesh import Mesh, MeshSpec, start_mesh


@contextmanager
def command_mesh(err) -> Iterator[Callable[[MeshSpec], Mesh]]:
    """Yields ``start(spec)``, which starts a local mesh and prints where its logs are (on
    ``err``, a rich Console); every mesh started is stopped when the block ends. Ctrl-C inside
    the block prints "interrupted" and exits 130."""
    meshes: list[Mesh] = []

    def start(spec: MeshSpec) -> Mesh:
        with err.status("starting a local mesh"):
            mesh = start_mesh(spec)
        meshes.append(mesh)
        err.print(f"local mesh at {mesh.gateway_address} "
                  f"(logs: {mesh.procs[0].log_path.parent})")
        return mesh

    try:
        yield start
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(130) from None
    finally:
        for mesh in meshes:
            mesh.stop()
