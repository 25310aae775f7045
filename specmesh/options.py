"""The command-line options the service commands share (`gateway`, `drafter`, `verifier`,
specmesh/cli.py), and the configs built from them."""

from __future__ import annotations

import os
from dataclasses import MISSING, fields
from typing import Annotated

import typer

from services.config import ModelServiceConfig

# The drafter's and the verifier's defaults, as their config holds them: the commands'
# options default to these (the Helm chart's values are checked against them by a test)
REPLICA = {f.name: f.default for f in fields(ModelServiceConfig) if f.default is not MISSING}

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

StallS = Annotated[float, typer.Option("--stall-s", envvar="SPECMESH_STALL_S",
                                       help="Health turns NOT_SERVING while one forward pass "
                                            "has run longer than this (a hung model thread; "
                                            "a liveness probe then restarts the replica), "
                                            "SERVING again once it ends (0 = off).")]


def telemetry_config(service: str, metrics_port: int, log_format: str, log_level: str):
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


ParentPid = Annotated[int, typer.Option(
    "--parent-pid", envvar="SPECMESH_PARENT_PID", min=0,
    help="Stop, as on SIGTERM, once the process with this pid is no longer this one's parent "
         "(it died): the local mesh (`specmesh up`, bench, load) sets it for the processes it "
         "starts, so that none outlives a parent that was killed; 0 = off.")]


def server_config(port: int, host: str, tls_cert: str, tls_key: str, tls_ca: str,
                  health_port: int, parent_pid: int = 0):
    from services.config import ServerConfig, TlsConfig

    try:
        return ServerConfig(port=port, host=host, health_port=health_port, parent_pid=parent_pid,
                            tls=TlsConfig(cert=tls_cert, key=tls_key, ca=tls_ca))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc


KvBudget = Annotated[int, typer.Option("--kv-budget-mb", envvar="SPECMESH_KV_BUDGET_MB",
                                       help="KV cache memory budget; idle sessions are "
                                            "evicted least recently used first, and on a "
                                            "CPU the KV pool gets no more slots than it "
                                            "holds; with --local-drafter it covers the "
                                            "draft model's caches too (0 = none).")]
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
PlainThreads = Annotated[int, typer.Option(
    "--plain-threads", envvar="SPECMESH_PLAIN_THREADS", min=0,
    help="torch CPU threads to try for a decode pass no drafter works beside, when more "
         "than --threads: one that verifies no drafts (target-only rounds, and rounds while "
         "drafts do not pay), or drafts with no speculation tree drafted beside it. The "
         "verifier measures its throughput both ways as it serves (now and then "
         "interleaving the two pass by pass), per kind of pass and batch size, and keeps "
         "the faster: the wider where it serves 10% more; 0 = --threads.")]
LocalDrafter = Annotated[str, typer.Option(
    "--local-drafter", envvar="SPECMESH_LOCAL_DRAFTER",
    help="A draft model (saved HF directory or hub name, the target's vocabulary) the "
         "verifier holds beside the target: its plain rounds (greedy, or unseeded, requests "
         "that speculate) then decode --local-draft-tokens drafts at a time, verified in "
         "its own passes, with no drafter call. The verifier measures whether that serves "
         "more, per batch size, and drafts only where it does; '' = none.")]
LocalDraftTokens = Annotated[int, typer.Option(
    "--local-draft-tokens", envvar="SPECMESH_LOCAL_DRAFT_TOKENS", min=1,
    help="Drafts of --local-drafter a pass verifies (at most --max-draft-tokens).")]
LocalDraftSessions = Annotated[int, typer.Option(
    "--local-draft-sessions", envvar="SPECMESH_LOCAL_DRAFT_SESSIONS", min=1,
    help="--local-drafter drafts only in passes of at most this many sessions. On a CPU a "
         "pass of k + 1 tokens a session costs nearly k + 1 passes from two sessions on, "
         "and drafting steps end calls sooner, which breaks up the batch: on the demo pair "
         "it paid at one session a pass only. Where a wider pass costs about one (a GPU), "
         "measure a higher value with `specmesh bench`.")]
Forward = Annotated[str, typer.Option("--forward", envvar="SPECMESH_FORWARD",
                                      help="auto: Llama-architecture models run a lean forward "
                                           "(less Python per call; on a CPU with weights "
                                           "prepacked for oneDNN, except that weights whose "
                                           "values are exactly 16-bit numbers get 16-bit "
                                           "copies instead, which passes of up to 32 tokens "
                                           "read, widened and summed in float32 by a kernel "
                                           "compiled on first use: logits within ~1e-5 of "
                                           "transformers'; on a CUDA device, decode and "
                                           "verify passes replayed as CUDA graphs); packed: "
                                           "no 16-bit copies; lean: no prepacking and no "
                                           "CUDA graphs either; hf: transformers' own "
                                           "forward.")]
