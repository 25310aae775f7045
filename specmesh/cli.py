"""`specmesh`: run the services, the local mesh, and a streaming client."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from specmesh import loadtest
from specmesh.extras import needs_extra
from specmesh.model_ref import model_reference

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="SpecMesh: lossless speculative decoding across drafter, verifier and "
                       "gateway gRPC services.")

Port = Annotated[int, typer.Option("--port", envvar="SPECMESH_PORT", help="Port to listen on.")]
Host = Annotated[str, typer.Option("--host", envvar="SPECMESH_HOST", help="Address to bind.")]
Model = Annotated[str, typer.Option("--model", envvar="SPECMESH_MODEL",
                                    help="HF causal LM: hub name or local path.")]
Device = Annotated[str, typer.Option("--device", envvar="SPECMESH_DEVICE",
                                     help="auto (CUDA when present), cpu or cuda[:N].")]
Dtype = Annotated[str, typer.Option("--dtype", envvar="SPECMESH_DTYPE",
                                    help="float32, float16 or bfloat16.")]
MaxSessions = Annotated[int, typer.Option("--max-sessions", envvar="SPECMESH_MAX_SESSIONS",
                                          help="KV caches kept; least recently used evicted.")]
MaxDraft = Annotated[int, typer.Option("--max-draft-tokens", envvar="SPECMESH_MAX_DRAFT_TOKENS",
                                       help="Largest k accepted per call.")]
Threads = Annotated[int, typer.Option("--threads", envvar="SPECMESH_THREADS",
                                      help="torch CPU threads (0 = torch's default).")]
MaxQueue = Annotated[int, typer.Option("--max-queue", envvar="SPECMESH_MAX_QUEUE",
                                       help="Calls waiting for the model before "
                                            "RESOURCE_EXHAUSTED.")]
MaxBatch = Annotated[int, typer.Option("--max-batch", envvar="SPECMESH_MAX_BATCH",
                                       help="Most calls of different sessions in one forward "
                                            "pass (continuous batching; 1 = off).")]
LogLevel = Annotated[str, typer.Option("--log-level", envvar="SPECMESH_LOG_LEVEL",
                                       help="debug, info, warning or error.")]
LogFormat = Annotated[str, typer.Option("--log-format", envvar="SPECMESH_LOG_FORMAT",
                                        help="json (one object per line, with trace ids) or "
                                             "text.")]
MetricsPort = Annotated[int, typer.Option("--metrics-port", envvar="SPECMESH_METRICS_PORT",
                                          help="Serve Prometheus metrics on this port "
                                               "(0 = off).")]


def _telemetry(service: str, metrics_port: int, log_format: str, log_level: str):
    """Telemetry settings; OTLP export follows the standard OTEL_* variables."""
    from services.telemetry import TelemetryConfig

    try:
        return TelemetryConfig(service=service, metrics_port=metrics_port, log_format=log_format,
                               log_level=log_level,
                               env={k: v for k, v in os.environ.items() if k.startswith("OTEL_")})
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc


Redis = Annotated[str, typer.Option("--redis", envvar="SPECMESH_REDIS_URL",
                                    help="Register in this Redis with a heartbeat and the load, "
                                         "for gateways with --discovery redis.")]
Advertise = Annotated[str, typer.Option("--advertise", envvar="SPECMESH_ADVERTISE",
                                        help="HOST:PORT gateways should dial (default: the "
                                             "bind address, or the hostname for 0.0.0.0).")]


TlsCert = Annotated[str, typer.Option("--tls-cert", envvar="SPECMESH_TLS_CERT",
                                      help="PEM certificate chain: serve TLS only.")]
TlsKey = Annotated[str, typer.Option("--tls-key", envvar="SPECMESH_TLS_KEY",
                                     help="PEM private key of --tls-cert.")]
TlsCa = Annotated[str, typer.Option("--tls-ca", envvar="SPECMESH_TLS_CA",
                                    help="The mesh's CA (PEM): drafters and verifiers accept only "
                                         "clients with a certificate it signed (mTLS); the "
                                         "gateway dials them over mTLS.")]
HealthPort = Annotated[int, typer.Option("--health-port", envvar="SPECMESH_HEALTH_PORT",
                                         help="Plaintext port serving only grpc.health.v1, for "
                                              "probes when TLS is on (0 = off).")]


def _server(port: int, host: str, tls_cert: str, tls_key: str, tls_ca: str, health_port: int):
    from services.config import ServerConfig, TlsConfig

    try:
        return ServerConfig(port=port, host=host, health_port=health_port,
                            tls=TlsConfig(cert=tls_cert, key=tls_key, ca=tls_ca))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc


KvBudget = Annotated[int, typer.Option("--kv-budget-mb", envvar="SPECMESH_KV_BUDGET_MB",
                                       help="KV cache memory budget; idle sessions are "
                                            "evicted least recently used first, and on a "
                                            "CPU the KV pool gets no more slots than it "
                                            "holds (0 = none).")]
PrefixCacheMb = Annotated[int, typer.Option(
    "--prefix-cache-mb", envvar="SPECMESH_PREFIX_CACHE_MB",
    help="Memory for KV blocks of committed prefixes, reused by sessions that start with the "
         "same tokens (system prompts, earlier turns); least recently used out first (0 = "
         "off).")]
PrefixBlock = Annotated[int, typer.Option("--prefix-block", envvar="SPECMESH_PREFIX_BLOCK",
                                          help="Tokens per prefix-cache block: a prompt reuses "
                                               "its cached prefix in whole blocks.")]
PrefillChunk = Annotated[int, typer.Option(
    "--prefill-chunk", envvar="SPECMESH_PREFILL_CHUNK", min=0,
    help="A longer prompt is computed this many tokens per forward pass (chunked prefill), "
         "so other sessions' calls run between its chunks; 0 = in one pass.")]
PrefillThreads = Annotated[int, typer.Option(
    "--prefill-threads", envvar="SPECMESH_PREFILL_THREADS", min=0,
    help="torch CPU threads for a forward pass that computes a prompt (or a chunk of one), "
         "when more than --threads: a prompt's pass is bound by compute, a decode pass by "
         "reading the weights; 0 = --threads.")]
Forward = Annotated[str, typer.Option("--forward", envvar="SPECMESH_FORWARD",
                                      help="auto: Llama-architecture models run a lean forward "
                                           "(less Python per call; on a CPU with weights "
                                           "prepacked for oneDNN: logits within ~1e-5 of "
                                           "transformers'); lean: the same without "
                                           "prepacking; hf: transformers' own forward.")]


def _model_service(kind: str, server, model, device, dtype, max_sessions, max_draft, threads,
                   max_queue, telemetry, drafter_kind: str = "model", redis: str = "",
                   advertise: str = "", kv_budget_mb: int = 0, max_batch: int = 16,
                   forward: str = "auto", prefix_cache_mb: int = 256,
                   prefix_block: int = 16, prefill_chunk: int = 256,
                   prefill_threads: int = 0) -> None:
    from services.config import ModelServiceConfig

    model = model_reference(model, "--model")
    try:
        config = ModelServiceConfig(server=server, model=model,
                                    device=device, dtype=dtype, max_sessions=max_sessions,
                                    max_draft_tokens=max_draft, threads=threads,
                                    max_queue=max_queue, max_batch=max_batch,
                                    kind=drafter_kind, redis_url=redis,
                                    advertise=advertise, kv_budget_mb=kv_budget_mb,
                                    forward=forward, prefix_cache_mb=prefix_cache_mb,
                                    prefix_block=prefix_block, prefill_chunk=prefill_chunk,
                                    prefill_threads=prefill_threads)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if kind == "drafter":
        from drafter_svc.server import run
    else:
        from verifier_svc.server import run
    run(config, telemetry)


@app.command()
def drafter(model: Model,
            kind: Annotated[str, typer.Option("--kind", envvar="SPECMESH_DRAFTER_KIND",
                                              help="model (a small causal LM) or ngram (prompt "
                                                   "lookup; --model then only names the "
                                                   "tokenizer and limits).")] = "model",
            port: Port = 50061, host: Host = "0.0.0.0", device: Device = "cpu",
            dtype: Dtype = "float32", max_sessions: MaxSessions = 256,
            max_draft_tokens: MaxDraft = 16, threads: Threads = 0, max_queue: MaxQueue = 64,
            max_batch: MaxBatch = 16, metrics_port: MetricsPort = 0,
            log_format: LogFormat = "json",
            log_level: LogLevel = "info", redis: Redis = "", advertise: Advertise = "",
            kv_budget_mb: KvBudget = 0, tls_cert: TlsCert = "", tls_key: TlsKey = "",
            tls_ca: TlsCa = "", health_port: HealthPort = 0, forward: Forward = "auto",
            prefix_cache_mb: PrefixCacheMb = 256, prefix_block: PrefixBlock = 16,
            prefill_chunk: PrefillChunk = 256, prefill_threads: PrefillThreads = 0) -> None:
    """Run a drafter: proposes draft tokens (with sparse q) from a small causal LM, or by
    prompt lookup (--kind ngram)."""
    _model_service("drafter", _server(port, host, tls_cert, tls_key, tls_ca, health_port), model,
                   device, dtype, max_sessions, max_draft_tokens,
                   threads, max_queue,
                   _telemetry("drafter", metrics_port, log_format, log_level), kind, redis,
                   advertise, kv_budget_mb, max_batch, forward, prefix_cache_mb, prefix_block,
                   prefill_chunk, prefill_threads)


@app.command()
def verifier(model: Model, port: Port = 50071, host: Host = "0.0.0.0", device: Device = "auto",
             dtype: Dtype = "float32", max_sessions: MaxSessions = 256,
             max_draft_tokens: MaxDraft = 16, threads: Threads = 0, max_queue: MaxQueue = 64,
             max_batch: MaxBatch = 16, metrics_port: MetricsPort = 0,
             log_format: LogFormat = "json",
             log_level: LogLevel = "info", redis: Redis = "",
             advertise: Advertise = "", kv_budget_mb: KvBudget = 0, tls_cert: TlsCert = "",
             tls_key: TlsKey = "", tls_ca: TlsCa = "", health_port: HealthPort = 0,
             forward: Forward = "auto", prefix_cache_mb: PrefixCacheMb = 256,
             prefix_block: PrefixBlock = 16, prefill_chunk: PrefillChunk = 256,
             prefill_threads: PrefillThreads = 0) -> None:
    """Run a verifier: holds the target model, verifies drafts in one forward pass."""
    _model_service("verifier", _server(port, host, tls_cert, tls_key, tls_ca, health_port), model,
                   device, dtype, max_sessions, max_draft_tokens,
                   threads, max_queue,
                   _telemetry("verifier", metrics_port, log_format, log_level), "model", redis,
                   advertise, kv_budget_mb, max_batch, forward, prefix_cache_mb, prefix_block,
                   prefill_chunk, prefill_threads)


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
             "decodes one (its time to the first token). 1: a call per token.")] = 4,
    spec_fanout: Annotated[int, typer.Option(
        envvar="SPECMESH_SPEC_FANOUT", min=1, max=64,
        help="Most branches (outcomes) the speculation cache drafts per round, while the "
             "drafter serves no other call (none while it does).")] = 16,
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
) -> None:
    """Run the gateway: the public specmesh.v1.Gateway API and the round loop."""
    from gateway.server import StartupError, run, without_torch
    from services.config import GatewayConfig, load_api_keys, parse_addresses

    without_torch()  # before --model is checked: transformers would import torch

    telemetry = _telemetry("gateway", metrics_port, log_format, log_level)
    server = _server(port, host, tls_cert, tls_key, tls_ca, health_port)
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
            spec_fallback=spec_fallback,
            max_support=max_support,
            default_drafter_kind=default_drafter_kind, pipeline=pipeline, spec_fanout=spec_fanout,
            step_batching=step_batching, spec_max_requests=spec_max_requests,
            plain_tokens=plain_tokens,
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
