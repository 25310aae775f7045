"""`specmesh api-key` and `specmesh certs`: credentials for a secured mesh."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer


def api_key(
    name: Annotated[str, typer.Argument(help="Who the key is for (shown in logs and errors).")],
    rate: Annotated[float, typer.Option(help="Requests per second (0 = unlimited).")] = 0.0,
    burst: Annotated[int, typer.Option(help="Requests allowed at once (0 = ceil(rate)).")] = 0,
) -> None:
    """Print a new random API key (give it to the client) and the entry for the gateway's
    --api-keys file (only the key's SHA-256 is stored there)."""
    from gateway.auth import new_key
    from services.config import ApiKey

    key, digest = new_key()
    try:
        entry = ApiKey(name=name, sha256=digest, rate_per_s=rate, burst=burst)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(f"API key (shown once): {key}", err=True)
    typer.echo(json.dumps(asdict(entry)))


def certs(
    out: Annotated[Path, typer.Option("--out", help="Folder for the PEM files.")],
    hosts: Annotated[str, typer.Option(help="Comma-separated DNS names / IPs the certificate "
                                            "must name.")] = "localhost,127.0.0.1",
    name: Annotated[str, typer.Option(help="Certificate file name (NAME.pem, NAME-key.pem).")
                    ] = "mesh",
    days: Annotated[int, typer.Option(help="Validity.")] = 365,
) -> None:
    """Create a private CA (unless OUT/ca.pem exists) and a certificate it signs, valid for
    TLS servers and clients: use it as --tls-cert/--tls-key/--tls-ca on every tier."""
    from services.certs import make_ca, make_cert

    if not (out / "ca.pem").exists():
        make_ca(out)
    try:
        files = make_cert(out, name, [h.strip() for h in hosts.split(",") if h.strip()], days)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(f"--tls-cert {files.cert} --tls-key {files.key} --tls-ca {files.ca}")
