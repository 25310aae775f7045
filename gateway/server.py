"""Gateway start-up: connect to Redis and the replicas, check the models agree, serve."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time

from gateway import clients
from gateway.auth import Authenticator
from gateway.chunks import TargetLimits
from gateway.engine import GenerationEngine
from gateway.replicas import ReplicaPool
from gateway.servicer import GatewayServicer
from services.config import GatewayConfig, redact_url
from services.errors import InvalidArgument, StartupError, Unavailable
from services.model_info import load_tokenizer, vocab_hash
from services.server import check_listenable, check_server_ports, serve
from services.session_store import SessionStore
from services.telemetry import Telemetry, TelemetryConfig, setup
from services.tls import channel_credentials
from specmesh.v1 import gateway_pb2, gateway_pb2_grpc

log = logging.getLogger(__name__)


async def _infos(pool: ReplicaPool, wait_s: float, replicas=None) -> dict[str, object]:
    """ModelInfo of every replica, waiting up to ``wait_s`` for each to answer."""
    deadline = time.monotonic() + wait_s
    infos: dict[str, object] = {}
    for replica in list(pool.replicas.values()) if replicas is None else replicas:
        address = replica.address
        while True:
            try:
                replica.info = await clients.model_info(replica, timeout=5.0)
                infos[address] = replica.info
                break
            except (clients.ReplicaFailed, InvalidArgument) as exc:
                if time.monotonic() > deadline:
                    log.warning("%s %s did not answer (%s); it is skipped until it does",
                                pool.kind, address, exc)
                    pool.mark_down(replica)
                    break
                await asyncio.sleep(0.5)
    return infos


def check_models(verifier_infos: dict, drafter_infos: dict, gateway_vocab: str) -> TargetLimits:
    """Verifiers must serve one target; drafters and the gateway's tokenizer share its vocabulary."""
    if not verifier_infos:
        raise StartupError("no verifier answered: check the --verifiers addresses")
    first_addr, first = next(iter(verifier_infos.items()))
    for address, info in verifier_infos.items():
        if info.fingerprint != first.fingerprint:
            raise StartupError(
                f"verifiers serve different targets: {first_addr} has {first.model} "
                f"({first.fingerprint}), {address} has {info.model} ({info.fingerprint})")
    vocab = first.vocab_hash or gateway_vocab
    for address, info in drafter_infos.items():
        if info.vocab_hash and vocab and info.vocab_hash != vocab:
            raise StartupError(
                f"drafter {address} ({info.model}) does not share the target's vocabulary "
                f"({first.model}): draft and target models must use the same tokenizer")
        if info.vocab_size > first.vocab_size:
            raise StartupError(
                f"drafter {address} has {info.vocab_size} output tokens, more than the target's "
                f"{first.vocab_size}: draft and target must share a vocabulary")
    if gateway_vocab and vocab and gateway_vocab != vocab:
        raise StartupError("the gateway's tokenizer (--model) differs from the verifiers' target")
    caps = [i.max_draft_tokens for i in [*verifier_infos.values(), *drafter_infos.values()]
            if i.max_draft_tokens > 0]
    return TargetLimits(vocab_size=first.vocab_size, max_context=first.max_context,
                        eos_token_ids=frozenset(first.eos_token_ids),
                        fingerprint=first.fingerprint, max_draft_tokens=min(caps, default=64))


class _Follower:
    """Applies a discovery backend's address changes to a pool, on the event loop, and
    admits a new replica once its model checks out."""

    def __init__(self, pool: ReplicaPool, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop
        self.limits: TargetLimits | None = None
        self.vocab = ""

    def on_change(self, addresses: frozenset[str]) -> None:  # called from discovery's thread
        self.loop.call_soon_threadsafe(self.apply, addresses)

    def apply(self, addresses: frozenset[str]) -> None:
        if addresses == frozenset(self.pool.replicas):
            return
        added = self.pool.update(addresses)
        log.info("%s replicas now: %s", self.pool.kind, ", ".join(sorted(addresses)) or "none")
        if added and self.limits is not None:
            for replica in added:
                replica.admitted = False  # no traffic until its model checks out
            self.loop.create_task(self._admit(added))

    async def _admit(self, replicas) -> None:
        for address, info in (await _infos(self.pool, 30.0, replicas)).items():
            compatible = (info.vocab_hash == self.vocab if self.pool.kind == "drafter"
                          else info.fingerprint == self.limits.fingerprint)
            replica = self.pool.replicas.get(address)
            if replica is None:
                continue
            if compatible:
                replica.admitted = True
            else:
                log.error("%s %s serves %s, which does not match this mesh's target; it is "
                          "not used", self.pool.kind, address, info.model)


def _start_discovery(config: GatewayConfig, followers: dict[str, _Follower]) -> list:
    from kubernetes import client
    from kubernetes import config as kube_config

    from gateway.discovery import KubernetesDiscovery

    try:
        kube_config.load_incluster_config()
    except kube_config.ConfigException:
        kube_config.load_kube_config()  # outside a cluster: KUBECONFIG or ~/.kube/config
    api = client.ApiClient()
    watchers = []
    for kind, service, port in (("verifier", config.verifier_service, config.verifier_port),
                                ("drafter", config.drafter_service, config.drafter_port)):
        if service:
            watcher = KubernetesDiscovery(api, config.namespace, service, port,
                                          followers[kind].on_change)
            watcher.start()
            watchers.append(watcher)
    return watchers


async def _poll_registry(client, followers: dict[str, _Follower], period_s: float = 1.0) -> None:
    """--discovery redis: applies the registry's live replicas (and their load) every period."""
    from redis.exceptions import RedisError

    from services.registry import list_replicas

    while True:
        for kind, follower in followers.items():
            try:
                live = await list_replicas(client, kind)
            except RedisError as exc:
                log.warning("replica registry unreachable: %s", exc)
                continue
            follower.apply(frozenset(live))
            for address, load in live.items():
                if address in follower.pool.replicas:
                    follower.pool.replicas[address].load = load
        await asyncio.sleep(period_s)


async def _wait_for_replicas(pool: ReplicaPool, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while not pool.replicas and time.monotonic() < deadline:
        await asyncio.sleep(0.2)


async def _main(config: GatewayConfig, telemetry: Telemetry, wait_s: float) -> None:
    options = config.server.grpc_options
    interceptors = telemetry.client_interceptors()
    static = config.discovery == "static"
    # mTLS to drafters and verifiers when a CA is configured; otherwise plaintext inside the mesh.
    creds = channel_credentials(config.server.tls) if config.server.tls.mutual else None
    # Call streams are cheaper per call, but a trace follows unary calls (one span each).
    streams = not telemetry.tracing
    steps = config.step_batching
    verifiers = ReplicaPool("verifier", config.verifiers if static else (),
                            config.replica_retry_s, options, interceptors, creds, streams, steps)
    drafters = ReplicaPool("drafter", config.drafters if static else (),
                           config.replica_retry_s, options, interceptors, creds, streams, steps)
    loop = asyncio.get_running_loop()
    followers = {"verifier": _Follower(verifiers, loop), "drafter": _Follower(drafters, loop)}
    watchers = _start_discovery(config, followers) if config.discovery == "kubernetes" else []
    store = SessionStore.from_url(config.redis_url, config.session_ttl_s, config.lease_s)
    try:
        await store.ping()
    except Unavailable as exc:
        raise StartupError(f"cannot use Redis at {redact_url(config.redis_url)}: {exc.__cause__ or exc}"
                           " (check the URL, its password and TLS settings)") from exc
    poller = (loop.create_task(_poll_registry(store.client, followers))
              if config.discovery == "redis" else None)
    if not static:
        await _wait_for_replicas(verifiers, wait_s)
        await _wait_for_replicas(drafters, min(wait_s, 10.0))
    verifier_infos = await _infos(verifiers, wait_s)
    drafter_infos = await _infos(drafters, wait_s)
    model = config.model or (next(iter(verifier_infos.values())).model if verifier_infos else "")
    tokenizer = load_tokenizer(model) if model else None
    if tokenizer is None:
        raise StartupError(f"no tokenizer found for the target {model!r}: pass --model")
    limits = check_models(verifier_infos, drafter_infos, vocab_hash(tokenizer))
    limits = dataclasses.replace(limits, model=model)
    for follower in followers.values():
        follower.limits, follower.vocab = limits, vocab_hash(tokenizer)
    engine = GenerationEngine(config, tokenizer, limits, drafters, verifiers, store,
                              tracer=telemetry.tracer, meter=telemetry.meter)

    auth = Authenticator(config.api_keys, store.client)
    if not auth.enabled:
        log.warning("no --api-keys: every client may use this gateway (fine on a private network)")

    def register(server) -> None:
        gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(engine, config, auth),
                                                       server)

    health: list = []  # the gRPC health servicer, once serve() has made it
    http = _http_server(config, engine, auth, telemetry, health)

    async def on_stop() -> None:
        if http is not None:
            await http.stop()
        for watcher in watchers:
            watcher.stop()
        if poller is not None:
            poller.cancel()
        await drafters.close()
        await verifiers.close()
        await store.close()
        telemetry.shutdown()

    name = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
    await serve(config.server, register, [name], on_stop=on_stop,
                interceptors=telemetry.server_interceptors(), on_health=health.append,
                on_started=(lambda _: http.start()) if http is not None else None)


def _http_server(config: GatewayConfig, engine: GenerationEngine, auth: Authenticator,
                 telemetry: Telemetry, health: list):
    """The OpenAI-compatible HTTP API (--http-port), bound now, served once gRPC is up;
    its readiness follows the gRPC health status (``health`` gets the servicer)."""
    if not config.http_port:
        return None
    from grpc_health.v1 import health_pb2

    from gateway.http.app import HttpContext, build_app
    from gateway.http.serve import HttpServer

    async def ready() -> bool:
        if not health:
            return False
        reply = await health[0].Check(health_pb2.HealthCheckRequest(service=""), None)
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    app = build_app(HttpContext(engine=engine, config=config, auth=auth, ready=ready,
                                tracer=telemetry.tracer, meter=telemetry.meter))
    try:
        return HttpServer(app, config.server, config.http_port)
    except OSError as exc:
        raise StartupError(f"cannot listen on HTTP port {config.http_port}: {exc.strerror}"
                           " (pick another --http-port)") from exc


def run(config: GatewayConfig, telemetry_config: TelemetryConfig, wait_s: float = 120.0) -> None:
    without_torch()
    # before waiting up to wait_s for the replicas: a taken port fails at once
    check_server_ports(config.server)
    check_listenable(config.server.host, config.http_port or 0, "--http-port")
    telemetry = setup(telemetry_config)
    asyncio.run(_main(config, telemetry, wait_s))


def without_torch() -> None:
    """The gateway never runs a model, but transformers imports torch whenever it is
    installed (loading a tokenizer pulls its config and RoPE modules). Marking torch absent
    in this process keeps a gateway of a full install as light as the torch-free image (no
    torch in memory, a faster start), and any torch import here fails loudly. Call it before
    anything in the process loads transformers (the CLI's gateway command does)."""
    sys.modules.setdefault("torch", None)
