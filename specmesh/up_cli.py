"""`specmesh up`: the whole mesh on this machine, supervised until SIGINT or SIGTERM.

The command takes both signals over on its first line (services/supervisor.py): a signal while
it checks the models ends it at once; one while the mesh starts or runs stops every process
already started (Redis, verifiers, drafters, gateway) and removes its temporary folder.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from specmesh.model_ref import check_loadable, model_reference


def default_pair() -> tuple[str, str]:
    """The demo pair shipped in models/ (docs/models.md); without it (an install that did not
    copy models/), a tiny random-weight pair that exercises the mesh but writes gibberish."""
    from services.local_mesh import default_cache_dir
    from services.tiny_models import build_tiny_pair

    shipped = Path(__file__).resolve().parent.parent / "models"
    if all((shipped / name / "model.safetensors").exists()
           for name in ("demo-target", "demo-drafter")):
        return str(shipped / "demo-target"), str(shipped / "demo-drafter")
    typer.echo("no demo pair in models/: using a tiny random-weight pair (gibberish output)",
               err=True)
    target, draft = build_tiny_pair(default_cache_dir() / "tiny-pair")
    return str(target), str(draft)


def _gateway_args(**options) -> tuple[str, ...]:
    """Command-line flags of the gateway options given (None = the gateway's default)."""
    args: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args += [flag, str(value)]
    return tuple(args)


def up(
    port: Annotated[int, typer.Option(min=1, max=65535, help="Gateway port.")] = 50051,
    drafters: Annotated[int, typer.Option(min=0, help="Model drafter processes.")] = 1,
    ngram_drafters: Annotated[int, typer.Option(
        min=0, help="Prompt-lookup drafter processes (requests with --drafter ngram need "
                    "one).")] = 0,
    verifiers: Annotated[int, typer.Option(min=1, help="Verifier processes.")] = 1,
    target: Annotated[str, typer.Option(
        help="Target model: a saved HF model directory or a hub name (default: the demo pair "
             "in models/).")] = "",
    draft: Annotated[str, typer.Option(
        help="Draft model, sharing the target's vocabulary (default: the demo pair in "
             "models/).")] = "",
    redis: Annotated[str, typer.Option(help="External Redis URL (default: an embedded "
                                            "redis-server).")] = "",
    log_dir: Annotated[Path | None, typer.Option(
        help="Keep the processes' logs here (default: a temporary folder, removed on "
             "exit).")] = None,
    metrics_port: Annotated[int, typer.Option(
        envvar="SPECMESH_METRICS_PORT", min=0, max=65535,
        help="Serve Prometheus metrics from BASE: the gateway on BASE, each verifier and "
             "drafter on the next ports, as printed (0 = off).")] = 0,
    num_draft_tokens: Annotated[int | None, typer.Option(
        min=0, help="Gateway: draft tokens per round for requests that set none (0 = "
                    "adaptive).")] = None,
    max_adaptive_k: Annotated[int | None, typer.Option(
        min=1, help="Gateway: largest k the adaptive choice may pick.")] = None,
    spec_fallback: Annotated[bool | None, typer.Option(
        "--spec-fallback/--no-spec-fallback",
        help="Gateway: the fixed k drops to 0 while drafts do not pay (default on).")] = None,
    pipeline: Annotated[bool | None, typer.Option(
        "--pipeline/--no-pipeline", help="Gateway: the speculation cache (default on).")] = None,
    lead_round: Annotated[bool | None, typer.Option(
        "--lead-round/--no-lead-round",
        help="Gateway: a new session's first round verifies alone while the drafter "
             "computes the prompt beside it (default on).")] = None,
    spec_fanout: Annotated[int | None, typer.Option(
        min=1, max=64, help="Gateway: most branches the speculation cache drafts per "
                            "round (default 16; fewer while a wider tree would end after "
                            "the verify).")] = None,
    spec_max_requests: Annotated[int | None, typer.Option(
        min=1, help="Gateway: the speculation cache drafts only while the gateway runs at "
                    "most this many requests (default 1).")] = None,
    step_batching: Annotated[bool | None, typer.Option(
        "--step-batching/--no-step-batching",
        help="Gateway: calls to a replica made while one is in flight go as one batched RPC "
             "(default on).")] = None,
    plain_tokens: Annotated[int | None, typer.Option(
        min=1, max=64, help="Gateway: tokens a round without drafts asks the verifier for "
                            "(default 8; 1: a call per token).")] = None,
    decode_ahead: Annotated[bool | None, typer.Option(
        "--decode-ahead/--no-decode-ahead",
        help="Gateway: the verifier starts a round without drafts' next one as soon as it "
             "answers (default on).")] = None,
    default_drafter_kind: Annotated[str | None, typer.Option(
        help="Gateway: drafter kind for requests that name none (model or ngram).")] = None,
    default_max_new_tokens: Annotated[int | None, typer.Option(
        min=1, help="Gateway: max_new_tokens of requests that set none.")] = None,
    max_new_tokens_cap: Annotated[int | None, typer.Option(
        min=1, help="Gateway: the largest max_new_tokens a request may ask for.")] = None,
    max_inflight: Annotated[int | None, typer.Option(
        min=1, help="Gateway: concurrent requests before RESOURCE_EXHAUSTED.")] = None,
    http_port: Annotated[int, typer.Option(
        min=0, max=65535, help="Gateway: port of the OpenAI-compatible HTTP API "
                               "(/v1/completions, /v1/chat/completions; docs/api.md); "
                               "0 = off.")] = 8000,
    local_drafts: Annotated[bool, typer.Option(
        "--local-drafts/--no-local-drafts",
        help="Verifiers hold the draft model too (--local-drafter): rounds without drafter "
             "calls draft in the verifier's own passes where that serves more, as it "
             "measures (default on).")] = True,
) -> None:
    """Start the whole mesh locally: Redis, drafters, verifiers and the gateway. SIGINT
    (Ctrl-C) or SIGTERM stops every process it started, at any point."""
    from services.supervisor import Stopped, StopSignals

    with StopSignals() as signals:
        try:
            code = _up(signals, port=port, drafters=drafters, ngram_drafters=ngram_drafters,
                       verifiers=verifiers, target=target, draft=draft, redis=redis,
                       log_dir=log_dir, metrics_port=metrics_port, local_drafts=local_drafts,
                       gateway_args=_gateway_args(
                           num_draft_tokens=num_draft_tokens, max_adaptive_k=max_adaptive_k,
                           spec_fallback=spec_fallback, lead_round=lead_round,
                           pipeline=pipeline, spec_fanout=spec_fanout,
                           spec_max_requests=spec_max_requests, step_batching=step_batching,
                           plain_tokens=plain_tokens, decode_ahead=decode_ahead,
                           default_drafter_kind=default_drafter_kind,
                           default_max_new_tokens=default_max_new_tokens,
                           max_new_tokens_cap=max_new_tokens_cap, max_inflight=max_inflight,
                           http_port=http_port or None))
        except Stopped:
            typer.echo(f"stopped by {_signame(signals.signum)} before anything was started",
                       err=True)
            code = signals.exit_code
    raise typer.Exit(code)


def _check_ports(spec, gateway_args: list[str]) -> None:
    """The ports the mesh's own processes must get (the gateway's, its HTTP port, the
    Prometheus ports), checked before anything starts: a taken one fails in a second with
    the option to change, not after the models load."""
    from services.errors import StartupError
    from services.server import check_listenable

    wanted = [(spec.host, spec.port, "--port"),
              (spec.host, int(_http_port(gateway_args) or 0), "--http-port"),
              *(("0.0.0.0", port, "--metrics-port") for port in spec.metrics_ports().values())]
    for host, port, option in wanted:
        try:
            check_listenable(host, port, option)
        except StartupError as exc:
            raise typer.BadParameter(str(exc), param_hint=f"'{option}'") from exc


def _http_port(gateway_args: list[str]) -> str:
    """The gateway's --http-port among its arguments ("" when it has none)."""
    if "--http-port" not in gateway_args:
        return ""
    return gateway_args[gateway_args.index("--http-port") + 1]


def _signame(signum: int) -> str:
    import signal

    return signal.Signals(signum).name


def _up(signals, *, port, drafters, ngram_drafters, verifiers, target, draft, redis, log_dir,
        metrics_port, gateway_args, local_drafts=True) -> int:
    from rich.console import Console

    from services.local_mesh import MeshSpec, StartCancelled, start_mesh
    from services.supervisor import watch

    console = Console(stderr=True)
    if bool(target) != bool(draft):
        raise typer.BadParameter("give both --target and --draft, or neither")
    if target:
        target, draft = model_reference(target, "--target"), model_reference(draft, "--draft")
        with console.status("checking the models"):
            check_loadable(target, "--target")
            check_loadable(draft, "--draft")
    else:
        with console.status("finding the demo model pair"):
            target, draft = default_pair()
    with console.status("checking that draft and target share a vocabulary"):
        _check_vocabularies(target, draft)
    spec = MeshSpec(target=target, draft=draft, port=port, drafters=drafters,
                    ngram_drafters=ngram_drafters, verifiers=verifiers, redis_url=redis,
                    log_dir=log_dir, metrics_port=metrics_port, extra_gateway_args=gateway_args,
                    local_drafts=local_drafts)
    if max(spec.metrics_ports().values()) > 65535:
        raise typer.BadParameter(f"{metrics_port} + {len(spec.metrics_ports()) - 1} services is "
                                 "past port 65535", param_hint="'--metrics-port'")
    _check_ports(spec, gateway_args)
    signals.raising = False  # from here on processes exist: the start-up polls signals.event
    try:
        with console.status("starting the mesh"):
            mesh = start_mesh(spec, progress=lambda m: console.print(f"  [green]SERVING[/] {m}"),
                              cancel=signals.event)
    except StartCancelled:
        console.print(f"stopped by {_signame(signals.signum)} during start-up; every process "
                      "started was stopped")
        return signals.exit_code
    except RuntimeError as exc:  # a process did not come up: its log's end is in the message
        kept = "" if log_dir else "\n(the temporary log folder is removed; --log-dir DIR keeps it)"
        typer.echo(f"error: {exc}{kept}", err=True)
        return 1
    try:
        exe = os.path.relpath(Path(sys.executable).parent / "specmesh")
        exe = exe if not exe.startswith("..") else "specmesh"
        logs = f"logs: {log_dir}" if log_dir else "logs: a temporary folder, removed on exit"
        host = mesh.gateway_address.rpartition(":")[0]
        http = ""
        if http_port := _http_port(gateway_args):
            http = f"OpenAI-compatible HTTP API: [bold]http://{host}:{http_port}/v1[/]\n"
        console.print(f"SpecMesh is up. Gateway: [bold]{mesh.gateway_address}[/]  ({logs})\n"
                      f"{http}"
                      f"Try: {exe} generate \"def fib(n):\" --addr {mesh.gateway_address}   — "
                      "Ctrl-C stops everything.")
        code = watch(mesh, signals.event)
    finally:
        mesh.stop()
    return code


def _check_vocabularies(target: str, draft: str) -> None:
    from services.models import load_tokenizer, vocab_hash

    t_vocab, d_vocab = vocab_hash(load_tokenizer(target)), vocab_hash(load_tokenizer(draft))
    if t_vocab and d_vocab and t_vocab != d_vocab:
        typer.echo(f"error: draft {draft} and target {target} do not share a vocabulary: pick "
                   "a draft model trained with the target's tokenizer", err=True)
        raise typer.Exit(2)
