"""Checking a model option (`--model`, `--target`, `--draft`) before anything loads it: a
local path that is not there is named as a missing path, not sent to the hub as a "repo id"."""

from __future__ import annotations

import re
from pathlib import Path

import typer

# What the Hugging Face hub accepts as a repo id: NAME or OWNER/NAME.
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def model_reference(value: str, option: str) -> str:
    """``value`` as given when it is a saved model directory or could be a hub name; a
    typer.BadParameter naming ``option`` and the path otherwise."""
    path = Path(value).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise typer.BadParameter(f"{value} has no config.json: not a saved Hugging Face "
                                     "model directory", param_hint=f"'{option}'")
        return str(path)
    if path.exists():
        raise typer.BadParameter(f"{value} is a file; give the model's directory",
                                 param_hint=f"'{option}'")
    looks_like_path = value.startswith(("/", ".", "~")) or "\\" in value or "//" in value
    if looks_like_path or not _HUB_NAME.fullmatch(value) or value.count("/") > 1:
        raise typer.BadParameter(f"no model directory at {value} (it does not exist)",
                                 param_hint=f"'{option}'")
    return value


def check_loadable(value: str, option: str) -> None:
    """For a value that is not a local directory: its config must load from the Hugging Face
    hub (or its cache), else a typer.BadParameter with the hub's one-line reason; checked
    before anything starts, so that no service fails later with a traceback in its log."""
    if Path(value).expanduser().is_dir():
        return
    import logging

    from transformers import AutoConfig

    quiet = logging.getLogger("huggingface_hub")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # no "Retrying in 1s" lines: the error says it all
    try:
        AutoConfig.from_pretrained(value)
    except Exception as exc:  # noqa: BLE001 - OSError, ValueError, the hub client's own errors
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise typer.BadParameter(f"{value} is not a local model directory, and loading it from "
                                 f"the Hugging Face hub failed: {reason}",
                                 param_hint=f"'{option}'") from exc
    finally:
        quiet.setLevel(level)
