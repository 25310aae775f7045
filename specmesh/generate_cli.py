"""`specmesh generate`: stream one completion from a gateway, then a one-line summary.

Every value is checked against the API's range before a request is built, so a bad value is
a one-line usage error (exit code 2), never a traceback from the protobuf layer.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1


def _drafter_kind(value: str) -> str:
    if value not in ("", "model", "ngram"):
        raise typer.BadParameter(f"{value!r} is not a drafter kind: model or ngram")
    return value


def _pem_file(value: str) -> str:
    if value and not Path(value).is_file():
        raise typer.BadParameter(f"no file at {value}")
    return value


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def summary(usage, seconds: float, finish: str, session_id: str, speculation: bool) -> str:
    """The line after the streamed text: tokens, rounds, acceptance (for a speculative
    request that drafted), tokens/s, finish reason and session."""
    parts = [_plural(usage.completion_tokens, "token"), _plural(usage.rounds, "round")]
    if not speculation:
        parts.append("target only")
    elif usage.draft_tokens:
        parts.append(f"acceptance {usage.accepted_draft_tokens / usage.draft_tokens:.0%} "
                     f"of {_plural(usage.draft_tokens, 'draft token')}")
    else:
        parts.append("no drafts proposed")
    parts.append(f"{usage.completion_tokens / max(seconds, 1e-9):.1f} tokens/s")
    parts.append(f"finish {finish}")
    parts.append(f"session {session_id}")
    return "[" + ", ".join(parts) + "]"


def generate(
    prompt: Annotated[str, typer.Argument(help="Prompt text.")],
    addr: Annotated[str, typer.Option(help="Gateway address, HOST:PORT.")] = "127.0.0.1:50051",
    max_new_tokens: Annotated[int | None, typer.Option(
        min=1, max=INT32_MAX,
        help="Most tokens to generate (default and cap: the gateway's settings).")] = None,
    temperature: Annotated[float | None, typer.Option(
        min=0.0, help="Sampling temperature; 0 = greedy (the default).")] = None,
    top_p: Annotated[float | None, typer.Option(
        min=0.0, max=1.0, help="Nucleus sampling: keep the smallest set of tokens whose "
                               "probability adds up to this, in (0, 1] (default 1 = off).")] = None,
    top_k: Annotated[int | None, typer.Option(
        min=0, max=INT32_MAX, help="Keep only the K most likely tokens (0 = off).")] = None,
    seed: Annotated[int | None, typer.Option(
        min=0, max=UINT64_MAX, help="Sampling seed: the same seed and request give the same "
                                    "output (default: random).")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    num_draft_tokens: Annotated[int, typer.Option(
        min=0, max=INT32_MAX, help="Draft tokens per round; 0 = the gateway's choice.")] = 0,
    no_speculation: Annotated[bool, typer.Option(
        "--no-speculation", help="Target-only decoding through the same services (the "
                                 "baseline).")] = False,
    drafter: Annotated[str, typer.Option(
        callback=_drafter_kind,
        help="Drafter kind: model or ngram (default: the gateway's).")] = "",
    session: Annotated[str, typer.Option(help="Continue this session.")] = "",
    keep_session: Annotated[bool, typer.Option(
        "--keep-session", help="Keep the session for later turns (see --session).")] = False,
    tls_ca: Annotated[str, typer.Option(envvar="SPECMESH_TLS_CA", callback=_pem_file,
                                        help="Verify a TLS gateway with this CA (PEM).")] = "",
    tls: Annotated[bool, typer.Option("--tls", help="TLS with the system's trusted "
                                                    "roots.")] = False,
    api_key: Annotated[str, typer.Option(envvar="SPECMESH_API_KEY",
                                         help="API key of a gateway started with --api-keys.")
                       ] = "",
) -> None:
    """Stream a completion from a gateway, then print a one-line summary."""
    import grpc

    from specmesh.client import GatewayClient, build_request, finish_name

    request = build_request(prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                            top_p=top_p, top_k=top_k, seed=seed, stop=stop,
                            num_draft_tokens=num_draft_tokens,
                            disable_speculation=no_speculation, drafter=drafter,
                            session_id=session, keep_session=keep_session)
    start = time.perf_counter()
    last = None
    try:
        with GatewayClient(addr, tls_ca=tls_ca, tls=tls, api_key=api_key) as client:
            for chunk in client.stream(request):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                last = chunk
    except grpc.RpcError as err:
        typer.echo(f"\nerror: {err.code().name}: {err.details()}", err=True)
        raise typer.Exit(1) from err
    if last is None:
        typer.echo("error: the gateway ended the stream without a result", err=True)
        raise typer.Exit(1)
    typer.echo("\n" + summary(last.usage, time.perf_counter() - start,
                              finish_name(last.finish_reason), last.session_id,
                              speculation=not no_speculation), err=True)
