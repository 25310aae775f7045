"""`specmesh`: run the services, the local mesh, and a streaming client."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from specmesh import loadtest
from specmesh.extras import needs_extra
from specmesh.model_ref import model_reference
from specmesh.options import (
    REPLICA as R,
)
from specmesh.options import (
    Advertise,
    Device,
    Dtype,
    Forward,
    HealthPort,
    Host,
    KvBudget,
    LocalDrafter,
    LocalDraftSessions,
    LocalDraftTokens,
    LogFormat,
    LogLevel,
    MaxBatch,
    MaxDraft,
    MaxQueue,
    MaxSessions,
    MetricsPort,
    Model,
    ParentPid,
    PlainThreads,
    Port,
    PrefillChunk,
    PrefillThreads,
    PrefixBlock,
    PrefixCacheMb,
    Redis,
    StallS,
    Threads,
    TlsCa,
    TlsCert,
    TlsKey,
    server_config,
    telemetry_config,
)

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="SpecMesh: lossless speculative decoding across drafter, verifier and "
                       "gateway gRPC services.")


def _model_service(kind: str, server, model, device, dtype, max_sessions, max_draft, threads,
                   max_queue, telemetry, drafter_kind: str, redis: str, advertise: str,
                   kv_budget_mb: int, max_batch: int, forward: str, prefix_cache_mb: int,
                   prefix_block: int, prefill_chunk: int, prefill_threads: int,
                   stall_s: float, plain_threads: int = R["plain_threads"],
                   local_drafter: str = "", local_draft_tokens: int = R["local_draft_tokens"],
                   local_draft_sessions: int = R["local_draft_sessions"]) -> None:
    from services.config import ModelServiceConfig

    model = model_reference(model, "--model")
    if local_drafter:
        local_drafter = model_reference(local_drafter, "--local-drafter")
    try:
        config = ModelServiceConfig(server=server, model=model,
                                    device=device, dtype=dtype, max_sessions=max_sessions,
                                    max_draft_tokens=max_draft, threads=threads,
                                    max_queue=max_queue, max_batch=max_batch,
                                    kind=drafter_kind, redis_url=redis,
                                    advertise=advertise, kv_budget_mb=kv_budget_mb,
                                    forward=forward, prefix_cache_mb=prefix_cache_mb,
                                    prefix_block=prefix_block, prefill_chunk=prefill_chunk,
                                    prefill_threads=prefill_threads,
                                    plain_threads=plain_threads, stall_s=stall_s,
                                    local_drafter=local_drafter,
                                    local_draft_tokens=local_draft_tokens,
                                    local_draft_sessions=local_draft_sessions)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    from services.models import device_problem

    if problem := device_problem(device):
        raise typer.BadParameter(problem, param_hint="'--device'")
    if kind == "drafter":
        from drafter_svc.server import run
    else:
        from verifier_svc.server import run
    from services.errors import StartupError

    try:
        run(config, telemetry)
    except StartupError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


@app.command()
def drafter(model: Model,
            kind: Annotated[str, typer.Option("--kind", envvar="SPECMESH_DRAFTER_KIND",
                                              help="model (a small causal LM) or ngram (prompt "
                                                   "lookup; --model then only names the "
                                                   "tokenizer and limits).")] = "model",
            port: Port = 50061, host: Host = "0.0.0.0", device: Device = "cpu",
            dtype: Dtype = R["dtype"], max_sessions: MaxSessions = R["max_sessions"],
            max_draft_tokens: MaxDraft = R["max_draft_tokens"], threads: Threads = R["threads"],
            max_queue: MaxQueue = R["max_queue"], max_batch: MaxBatch = R["max_batch"],
            metrics_port: MetricsPort = 0, log_format: LogFormat = "json",
            log_level: LogLevel = "info", redis: Redis = "", advertise: Advertise = "",
            kv_budget_mb: KvBudget = R["kv_budget_mb"], tls_cert: TlsCert = "",
            tls_key: TlsKey = "", tls_ca: TlsCa = "", health_port: HealthPort = 0,
            forward: Forward = R["forward"], prefix_cache_mb: PrefixCacheMb = R["prefix_cache_mb"],
            prefix_block: PrefixBlock = R["prefix_block"],
            prefill_chunk: PrefillChunk = R["prefill_chunk"],
            prefill_threads: PrefillThreads = R["prefill_threads"],
            stall_s: StallS = R["stall_s"], parent_pid: ParentPid = 0) -> None:
    """Run a drafter: proposes draft tokens (with sparse q) from a small causal LM, or by
    prompt lookup (--kind ngram)."""
    _model_service("drafter", server_config(port, host, tls_cert, tls_key, tls_ca, health_port,
                                           parent_pid), model,
                   device, dtype, max_sessions, max_draft_tokens,
                   threads, max_queue,
                   telemetry_config("drafter", metrics_port, log_format, log_level), kind, redis,
                   advertise, kv_budget_mb, max_batch, forward, prefix_cache_mb, prefix_block,
                   prefill_chunk, prefill_threads, stall_s)


@app.command()
def verifier(model: Model, port: Port = 50071, host: Host = "0.0.0.0", device: Device = "auto",
             dtype: Dtype = R["dtype"], max_sessions: MaxSessions = R["max_sessions"],
             max_draft_tokens: MaxDraft = R["max_draft_tokens"], threads: Threads = R["threads"],
             max_queue: MaxQueue = R["max_queue"], max_batch: MaxBatch = R["max_batch"],
             metrics_port: MetricsPort = 0, log_format: LogFormat = "json",
             log_level: LogLevel = "info", redis: Redis = "", advertise: Advertise = "",
             kv_budget_mb: KvBudget = R["kv_budget_mb"], tls_cert: TlsCert = "",
             tls_key: TlsKey = "", tls_ca: TlsCa = "", health_port: HealthPort = 0,
             forward: Forward = R["forward"], prefix_cache_mb: PrefixCacheMb = R["prefix_cache_mb"],
             prefix_block: PrefixBlock = R["prefix_block"],
             prefill_chunk: PrefillChunk = R["prefill_chunk"],
             prefill_threads: PrefillThreads = R["prefill_threads"],
             plain_threads: PlainThreads = R["plain_threads"],
             stall_s: StallS = R["stall_s"], parent_pid: ParentPid = 0,
             local_drafter: LocalDrafter = R["local_drafter"],
             local_draft_tokens: LocalDraftTokens = R["local_draft_tokens"],
             local_draft_sessions: LocalDraftSessions = R["local_draft_sessions"]) -> None:
    """Run a verifier: holds the target model, verifies drafts in one forward pass."""
    _model_service("verifier", server_config(port, host, tls_cert, tls_key, tls_ca, health_port,
                                            parent_pid), model,
                   device, dtype, max_sessions, max_draft_tokens,
                   threads, max_queue,
                   telemetry_config("verifier", metrics_port, log_format, log_level), "model", redis,
                   advertise, kv_budget_mb, max_batch, forward, prefix_cache_mb, prefix_block,
                   prefill_chunk, prefill_threads, stall_s, plain_threads, local_drafter,
                   local_draft_tokens, local_draft_sessions)


@app.command()
def gateway(
    redis: Annotated[str, typer.Option("--redis", envvar="SPECMESH_REDIS_URL",
                                       help="Redis URL (redis://, rediss://, unix://).")],
    verifiers: Annotated[str, typer.Option("--verifiers", envvar="SPECMESH_VERIFIERS",
                                           help="Verifier addresses, HOST:PORT,... (static "
                                                "discovery).")] = "",
    drafters: Annotated[str, typer.Option("--drafters", envvar="SPECMESH_DRAFTERS",
                                          help="Drafter addresses, HOST:PORT,...")] = "",
    model: Annotated[str, typer.Option("--model", envvar="SPECMESH_MODEL",
                                       help="Target model for the tokenizer (default: the "
                                            "model the verifiers report).")] = "",
    port: Port = 50051,
    host: Host = "0.0.0.0",
    discovery: Annotated[str, typer.Option(
        envvar="SPECMESH_DISCOVERY",
        help="static (--drafters/--verifiers), kubernetes (the ready endpoints of "
             "--drafter-service and --verifier-service, followed live) or redis (replicas "
             "started with --redis register themselves).")] = "static",
    namespace: Annotated[str, typer.Option(envvar="SPECMESH_NAMESPACE",
                                           help="Namespace of those Services.")] = "default",
    drafter_service: Annotated[str, typer.Option(envvar="SPECMESH_DRAFTER_SERVICE",
                                                 help="Drafters' headless Service.")] = "",
    verifier_service: Annotated[str, typer.Option(envvar="SPECMESH_VERIFIER_SERVICE",
                                                  help="Verifiers' headless Service.")] = "",
    drafter_port: Annotated[int, typer.Option(envvar="SPECMESH_DRAFTER_PORT",
                                              help="Drafters' gRPC port.")] = 50061,
    verifier_port: Annotated[int, typer.Option(envvar="SPECMESH_VERIFIER_PORT",
                                               help="Verifiers' gRPC port.")] = 50071,
    num_draft_tokens: Annotated[int, typer.Option(
        envvar="SPECMESH_NUM_DRAFT_TOKENS",
        help="Draft tokens per round for requests that set none; 0 = adaptive (opt-in: on "
             "the bench a fixed k is faster, see docs/performance.md).")] = 3,
    max_adaptive_k: Annotated[int, typer.Option(
        envvar="SPECMESH_MAX_ADAPTIVE_K", help="Largest k the adaptive choice may pick.")] = 8,
    spec_fallback: Annotated[bool, typer.Option(
        "--spec-fallback/--no-spec-fallback", envvar="SPECMESH_SPEC_FALLBACK",
        help="With a fixed --num-draft-tokens: a request drafts no tokens while, by its "
             "measured acceptance and the measured round times, drafts cost more than they "
             "yield (a drafter poor on this text, a long context), probing now and then. "
             "Not for requests that set their own k or sample with a seed.")] = True,
    default_drafter_kind: Annotated[str, typer.Option(
        envvar="SPECMESH_DEFAULT_DRAFTER_KIND",
        help="Drafter kind for requests that name none: model or ngram.")] = "model",
    pipeline: Annotated[bool, typer.Option(
        "--pipeline/--no-pipeline", envvar="SPECMESH_PIPELINE",
        help="Speculation cache: while the verifier checks a round, the model drafter drafts "
             "the next round for its likely outcomes; a hit needs no draft call.")] = True,
    tree_switch: Annotated[bool, typer.Option(
        "--tree-switch/--no-tree-switch", envvar="SPECMESH_TREE_SWITCH",
        help="With --pipeline: measure, as it serves, whether a lone request's rounds serve "
             "more with such a tree or without (the tree holds the drafter's core, which the "
             "verifier's pass could use), and keep the faster. Off: always draft trees (a "
             "drafter with hardware of its own).")] = True,
    lead_round: Annotated[bool, typer.Option(
        "--lead-round/--no-lead-round", envvar="SPECMESH_LEAD_ROUND",
        help="A session no drafter holds yet starts with a round that verifies no drafts "
             "while the drafter computes the prompt and drafts beside it: the first token "
             "waits for the verifier alone.")] = True,
    step_batching: Annotated[bool, typer.Option(
        "--step-batching/--no-step-batching", envvar="SPECMESH_STEP_BATCHING",
        help="Draft and Verify calls made while one to the same replica is in flight go "
             "together as its next step, one batched RPC: under load each forward pass "
             "holds every session that is ready.")] = True,
    plain_tokens: Annotated[int, typer.Option(
        envvar="SPECMESH_PLAIN_TOKENS", min=1, max=64,
        help="A round without drafts (target-only, or while drafts do not pay) asks the "
             "verifier for up to this many tokens, decoded one forward pass each without a "
             "call between them; its chunk carries them all. A request's first round "
             "decodes one (its time to the first token). 1: a call per token.")] = 8,
    decode_ahead: Annotated[bool, typer.Option(
        "--decode-ahead/--no-decode-ahead", envvar="SPECMESH_DECODE_AHEAD",
        help="A round without drafts asks the verifier to start the session's next such "
             "round as soon as it answers, so that the target decodes while the gateway "
             "streams and commits the round; the next call takes those tokens over (any "
             "other call stops them). Outputs do not change.")] = True,
    spec_fanout: Annotated[int, typer.Option(
        envvar="SPECMESH_SPEC_FANOUT", min=1, max=64,
        help="Most branches (outcomes) the speculation cache drafts per round, while the "
             "drafter serves no other call (none while it does). Within it, the gateway "
             "keeps the tree as wide as ends by the time the round's verify does (at least "
             "4).")] = 16,
    spec_max_requests: Annotated[int, typer.Option(
        envvar="SPECMESH_SPEC_MAX_REQUESTS", min=1,
        help="The speculation cache drafts only while the gateway runs at most this many "
             "requests: where drafter and verifier share cores a tree's CPU slows the "
             "verifier under load. Raise it when the drafters have hardware of their "
             "own.")] = 1,
    prefix_affinity: Annotated[int, typer.Option(
        envvar="SPECMESH_PREFIX_AFFINITY", min=-1,
        help="A new session goes to the replica whose prefix cache holds the longest prefix "
             "of its prompt (the prefix index in Redis) while that replica runs at most this "
             "many more requests than the least busy one; -1 routes by load alone.")] = 4,
    max_support: Annotated[int, typer.Option(envvar="SPECMESH_MAX_SUPPORT",
                                             help="Largest sparse-q support per position.")] = 32,
    default_max_new_tokens: Annotated[int, typer.Option(
        envvar="SPECMESH_DEFAULT_MAX_NEW_TOKENS",
        help="max_new_tokens of requests that set none.")] = 128,
    max_new_tokens_cap: Annotated[int, typer.Option(
        envvar="SPECMESH_MAX_NEW_TOKENS_CAP",
        help="Largest max_new_tokens a request may ask for (more: INVALID_ARGUMENT).")] = 4096,
    session_ttl_s: Annotated[int, typer.Option(
        envvar="SPECMESH_SESSION_TTL_S",
        help="Seconds a kept session's handle lives in Redis after its last use.")] = 3600,
    max_inflight: Annotated[int, typer.Option(envvar="SPECMESH_MAX_INFLIGHT",
                                              help="Concurrent requests before "
                                                   "RESOURCE_EXHAUSTED.")] = 64,
    rpc_timeout_s: Annotated[float, typer.Option(
        envvar="SPECMESH_RPC_TIMEOUT_S",
        help="Deadline of each call to a drafter or verifier, in seconds.")] = 30.0,
    store_outage_s: Annotated[float, typer.Option(
        "--store-outage-s", envvar="SPECMESH_STORE_OUTAGE_S",
        help="How long a finished request on a kept session waits for an unreachable Redis "
             "to save its last tokens before it fails with UNAVAILABLE.")] = 30.0,
    metrics_port: MetricsPort = 0,
    log_format: LogFormat = "json",
    log_level: LogLevel = "info",
    tls_cert: TlsCert = "",
    tls_key: TlsKey = "",
    tls_ca: TlsCa = "",
    health_port: HealthPort = 0,
    api_keys: Annotated[str, typer.Option(
        "--api-keys", envvar="SPECMESH_API_KEYS",
        help="JSON file of API keys (SHA-256 digests, per-key rate limits; see "
             "`specmesh api-key`). Without it the gateway accepts every client.")] = "",
    http_port: Annotated[int, typer.Option(
        "--http-port", envvar="SPECMESH_HTTP_PORT",
        help="Serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
             "/v1/models; docs/api.md) on this port, with the same TLS and API keys; "
             "0 = off.")] = 0,
    parent_pid: ParentPid = 0,
) -> None:
    """Run the gateway: the public specmesh.v1.Gateway API and the round loop."""
    from gateway.server import run, without_torch
    from services.config import GatewayConfig, load_api_keys, parse_addresses
    from services.errors import StartupError

    without_torch()  # before --model is checked: transformers would import torch

    telemetry = telemetry_config("gateway", metrics_port, log_format, log_level)
    server = server_config(port, host, tls_cert, tls_key, tls_ca, health_port, parent_pid)
    model = model_reference(model, "--model") if model else ""
    if discovery == "kubernetes":
        from gateway.discovery import require_kubernetes

        try:
            require_kubernetes()
        except ImportError as exc:
            raise typer.BadParameter(str(exc), param_hint="'--discovery'") from exc
    try:
        config = GatewayConfig(
            server=server, model=model, redis_url=redis,
            api_keys=load_api_keys(api_keys) if api_keys else (),
            drafters=parse_addresses(drafters), verifiers=parse_addresses(verifiers),
            num_draft_tokens=num_draft_tokens, max_adaptive_k=max_adaptive_k,
            spec_fallback=spec_fallback, tree_switch=tree_switch,
            max_support=max_support,
            default_drafter_kind=default_drafter_kind, pipeline=pipeline, spec_fanout=spec_fanout,
            step_batching=step_batching, spec_max_requests=spec_max_requests,
            plain_tokens=plain_tokens, decode_ahead=decode_ahead,
            lead_round=lead_round,
            prefix_affinity=prefix_affinity, discovery=discovery,
            namespace=namespace, drafter_service=drafter_service,
            verifier_service=verifier_service, drafter_port=drafter_port,
            verifier_port=verifier_port,
            default_max_new_tokens=default_max_new_tokens,
            max_new_tokens_cap=max_new_tokens_cap, session_ttl_s=session_ttl_s,
            max_inflight=max_inflight, rpc_timeout_s=rpc_timeout_s,
            store_outage_s=store_outage_s, http_port=http_port)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    try:
        run(config, telemetry)
    except StartupError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


from specmesh import (  # noqa: E402 - commands in their own modules
    distill_cli,
    generate_cli,
    security_cli,
    up_cli,
)

app.command("up")(up_cli.up)
app.command("generate")(generate_cli.generate)
app.command("distill")(distill_cli.distill)
app.command("api-key")(security_cli.api_key)
app.command("certs")(security_cli.certs)


app.command("load")(needs_extra("bench", ("psutil",), loadtest.load))

from specmesh import bench  # noqa: E402 - `specmesh bench`, in its own module like load

app.command("bench")(needs_extra("bench", ("matplotlib",), bench.bench))


# click's UsageError (BadParameter, NoSuchOption, MissingParameter, ...), whether typer
# vendors click or uses the package.
_UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


def main() -> None:
    """Runs the CLI; a bad value or option is one line on stderr and exit code 2."""
    try:
        code = app(standalone_mode=False)
    except _UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # `specmesh` alone: the help
            exc.show()
        else:
            where = f" (see {exc.ctx.command_path} --help)" if exc.ctx is not None else ""
            print(f"error: {exc.format_message()}{where}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
