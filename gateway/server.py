"""Gateway start-up: connect to Redis and the replicas, check the models agree, serve."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from gateway import clients
from gateway.engine import GenerationEngine, TargetLimits
from gateway.replicas import ReplicaPool
from gateway.servicer import GatewayServicer
from services.config import GatewayConfig
from services.errors import InvalidArgument
from services.metrics import GatewayMetrics
from services.models import load_tokenizer, vocab_hash
from services.server import serve
from services.session_store import SessionStore
from services.telemetry import Telemetry, TelemetryConfig, setup
from specmesh.v1 import gateway_pb2, gateway_pb2_grpc

log = logging.getLogger(__name__)


class StartupError(RuntimeError):
    """The mesh cannot serve as configured; the message says what to fix."""


async def _infos(pool: ReplicaPool, wait_s: float) -> dict[str, object]:
    """ModelInfo of every replica, waiting up to ``wait_s`` for each to answer."""
    deadline = time.monotonic() + wait_s
    infos: dict[str, object] = {}
    for address, replica in pool.replicas.items():
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
    return TargetLimits(vocab_size=first.vocab_size, max_context=first.max_context,
                        eos_token_ids=frozenset(first.eos_token_ids),
                        fingerprint=first.fingerprint)


async def _main(config: GatewayConfig, telemetry: Telemetry, wait_s: float) -> None:
    options = config.server.grpc_options
    interceptors = telemetry.client_interceptors()
    verifiers = ReplicaPool("verifier", config.verifiers, config.replica_retry_s, options,
                            interceptors)
    drafters = ReplicaPool("drafter", config.drafters, config.replica_retry_s, options,
                           interceptors)
    store = SessionStore.from_url(config.redis_url, config.session_ttl_s, config.lease_s)
    await store.ping()
    verifier_infos = await _infos(verifiers, wait_s)
    drafter_infos = await _infos(drafters, wait_s)
    model = config.model or (next(iter(verifier_infos.values())).model if verifier_infos else "")
    tokenizer = load_tokenizer(model) if model else None
    if tokenizer is None:
        raise StartupError(f"no tokenizer found for the target {model!r}: pass --model")
    limits = check_models(verifier_infos, drafter_infos, vocab_hash(tokenizer))
    limits = dataclasses.replace(limits, model=model)
    engine = GenerationEngine(config, tokenizer, limits, drafters, verifiers, store)
    engine.tracer = telemetry.tracer
    engine.metrics = GatewayMetrics(telemetry.meter, lambda: engine.inflight)

    def register(server) -> None:
        gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(engine, config), server)

    async def on_stop() -> None:
        await drafters.close()
        await verifiers.close()
        await store.close()
        telemetry.shutdown()

    name = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
    await serve(config.server, register, [name], on_stop=on_stop,
                interceptors=telemetry.server_interceptors())


def run(config: GatewayConfig, telemetry_config: TelemetryConfig, wait_s: float = 120.0) -> None:
    telemetry = setup(telemetry_config)
    asyncio.run(_main(config, telemetry, wait_s))
