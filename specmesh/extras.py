"""Commands that need an optional extra say which one when it is missing, before they run.

The base install serves (gateway, drafter, verifier, `up`, `generate`); `specmesh bench` and
`specmesh load` need the ``bench`` extra (pyproject.toml). Checked by module presence, without
importing anything.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import typer


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a finder refused it, or a broken half-import
        return False


def missing_modules(modules: tuple[str, ...]) -> list[str]:
    return [name for name in modules if not _installed(name)]


def needs_extra(extra: str, modules: tuple[str, ...], command: Callable) -> Callable:
    """``command`` (a typer command function) that first checks ``modules`` are installed and
    otherwise exits 2 with one line naming ``pip install 'specmesh[extra]'``."""

    @functools.wraps(command)
    def checked(*args, **kwargs):
        missing = missing_modules(modules)
        if missing:
            typer.echo(f"error: this command needs the {extra} extra (missing: "
                       f"{', '.join(missing)}): pip install 'specmesh[{extra}]'", err=True)
            raise typer.Exit(2)
        return command(*args, **kwargs)

    return checked
