"""What the drafter and verifier services share: building the model parts, the
Release / GetModelInfo / GetStats RPCs, telemetry of each call, and running the server."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

import redis.asyncio as aioredis
import torch
from opentelemetry import trace

from services.call_stream import Drain
from services.config import ModelServiceConfig
from services.convert import meta_to_pb, stats_to_pb
from services.errors import InvalidArgument, ResyncRequired, StartupError, grpc_errors
from services.kv_cache import SessionCaches
from services.messages import CacheDelta
from services.metrics import ModelServiceMetrics
from services.model_runner import ModelRunner
from services.models import kv_bytes_per_token, load_for_serving
from services.plain_threads import PlainThreads
from services.prefix_cache import PrefixCache
from services.prefix_index import IndexPublisher
from services.registry import Registration
from services.server import serve
from services.stall_watch import StallWatch
from services.telemetry import Telemetry
from specmesh.v1 import common_pb2

log = logging.getLogger(__name__)


def plain_threads(config: ModelServiceConfig, device: torch.device) -> PlainThreads | None:
    """The choice of threads for a verifier's passes without drafts (--plain-threads), when
    it asks for more than the process's threads on a CPU (an accelerator's passes do not
    run on torch's CPU threads)."""
    narrow = torch.get_num_threads()
    if config.plain_threads <= narrow:
        return None
    if device.type != "cpu":
        log.info("--plain-threads %d ignored: the model runs on %s", config.plain_threads,
                 device)
        return None
    log.info("passes without drafts are measured on %d and on %d torch threads; the faster "
             "is kept", narrow, config.plain_threads)
    return PlainThreads(narrow, config.plain_threads)


def budget_tokens(config: ModelServiceConfig, models: Sequence, context: int,
                  whose: str = "") -> int | None:
    """The tokens --kv-budget-mb holds of the caches of ``models`` together (a session's
    cache in each holds about its tokens; None: no budget), each model's KV pool bounded to
    the slots that many tokens fill (a slot's pages stay with the process once written). A
    budget that cannot hold one full-context session is refused (StartupError: one line)."""
    max_tokens = None
    if config.kv_budget_mb:
        per_token = sum(kv_bytes_per_token(model) for model in models)
        max_tokens = config.kv_budget_mb * 1024 * 1024 // per_token
        if max_tokens < context:
            raise StartupError(
                f"--kv-budget-mb {config.kv_budget_mb} holds {max_tokens} tokens{whose}, less "
                f"than one full-context session ({context} tokens of {per_token} bytes): "
                "raise it")
    for model in models:
        pool = getattr(model, "pool", None)  # the lean forward's KV slots (services/kv_slab.py)
        if pool is not None:
            pool.bound(min(config.max_sessions,
                           max_tokens // pool.slot_len if max_tokens else pool.max_slots))
    return max_tokens


def build_parts(config: ModelServiceConfig) -> tuple[ModelRunner, SessionCaches]:
    model, meta, device = load_for_serving(config.model, config.device, config.dtype,
                                           config.threads, config.forward)
    runner = ModelRunner(model, meta, device, config.max_queue, config.max_batch,
                         config.prefill_threads, plain_threads(config, device))
    max_tokens = budget_tokens(config, [model], meta.max_context)
    per_block = kv_bytes_per_token(model) * config.prefix_block
    prefix = PrefixCache(config.prefix_block, config.prefix_cache_mb * 1024 * 1024 // per_block)
    return runner, SessionCaches(config.max_sessions, runner.new_kv, max_tokens, prefix)


def build_metrics(telemetry: Telemetry, kind: str, engine,
                  config: ModelServiceConfig) -> ModelServiceMetrics:
    runner = getattr(engine, "runner", None)
    per_token = kv_bytes_per_token(runner.model) if runner is not None else 0
    capacity = per_token * engine.meta.max_context * config.max_sessions
    return ModelServiceMetrics(
        telemetry.meter, kind, queue_depth=lambda: engine.queue_depth,
        sessions=lambda: len(engine.caches),
        kv_bytes=lambda: per_token * engine.caches.total_tokens(),
        kv_capacity_bytes=lambda: capacity, prefix=engine.caches.prefix,
        pool=getattr(getattr(runner, "model", None), "pool", None),
        plain=getattr(runner, "plain", None))


class ModelServiceRpcs:
    """Release, GetModelInfo, GetStats and call telemetry for a servicer whose ``engine``
    has ``meta``, ``queue_depth``, ``caches``, ``stats``, ``max_draft_tokens``, ``kind``
    and ``close()``."""

    engine = None
    metrics: ModelServiceMetrics | None = None

    async def observed(self, delta: CacheDelta, work: Callable[[], Awaitable]):
        """Runs one Draft/Verify, annotating the server span and recording metrics."""
        span = trace.get_current_span()
        span.set_attribute("specmesh.session_id", delta.session_id)
        span.set_attribute("specmesh.base_len", delta.base_len)
        span.set_attribute("specmesh.cache", "hit" if delta.base_len else "prefill")
        m = self.metrics
        m.inflight.add(1)
        outcome = "error"
        try:
            result = await work()
            outcome = "ok"
        except ResyncRequired:
            outcome = "resync"
            span.set_attribute("specmesh.cache", "resync")
            raise
        finally:
            m.inflight.add(-1)
            m.calls.add(1, {"outcome": outcome})
        span.set_attribute("specmesh.forward_ms", result.compute_ms)
        span.set_attribute("specmesh.batch_size", result.batch_size)
        m.forward.record(result.compute_ms / 1000.0)
        m.batch_size.record(result.batch_size)
        m.fed_tokens.add(len(delta.new_tokens))
        return result

    async def observed_many(self, deltas: Sequence[CacheDelta],
                            work: Callable[[], Awaitable[list]]) -> list:
        """Runs the calls of one batched RPC (``work`` answers each with its result or its
        error) and records per call what ``observed`` records, the counters added once for
        the batch; the server span gets the batch's summary."""
        m = self.metrics
        m.inflight.add(len(deltas))
        try:
            outcomes = await work()
        finally:
            m.inflight.add(-len(deltas))
        counts: Counter[str] = Counter()
        fed = 0
        for delta, outcome in zip(deltas, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                counts["resync" if isinstance(outcome, ResyncRequired) else "error"] += 1
                continue
            counts["ok"] += 1
            fed += len(delta.new_tokens)
            m.forward.record(outcome.compute_ms / 1000.0)
            m.batch_size.record(outcome.batch_size)
        for outcome, n in counts.items():
            m.calls.add(n, {"outcome": outcome})
        m.fed_tokens.add(fed)
        span = trace.get_current_span()
        span.set_attribute("specmesh.calls", len(deltas))
        span.set_attribute("specmesh.failed_calls", len(deltas) - counts["ok"])
        return outcomes

    @grpc_errors
    async def Release(self, request, context):
        if not request.session_id:
            raise InvalidArgument("session_id is required")
        return common_pb2.ReleaseResponse(released=await self.engine.release(request.session_id))

    @grpc_errors
    async def GetModelInfo(self, request, context):
        prefix = self.engine.caches.prefix
        return meta_to_pb(self.engine.meta, self.engine.kind, self.engine.max_draft_tokens,
                          prefix.block if prefix is not None else 0)

    @grpc_errors
    async def GetStats(self, request, context):
        e = self.engine
        return stats_to_pb(e.stats, e.caches, queue_depth=e.queue_depth)


def replica_load(engine, config: ModelServiceConfig) -> dict:
    """What a replica reports to the registry: the gateway routes new sessions by it."""
    runner = getattr(engine, "runner", None)
    per_token = kv_bytes_per_token(runner.model) if runner is not None else 0
    used = per_token * engine.caches.total_tokens()
    capacity = per_token * engine.meta.max_context * config.max_sessions
    return {"kind": engine.kind, "sessions": len(engine.caches),
            "queue_depth": engine.queue_depth, "kv_free_bytes": max(0, capacity - used)}


def run_service(config: ModelServiceConfig, telemetry: Telemetry, engine,
                register: Callable, service_name: str, role: str,
                drain: Drain | None = None) -> None:
    registration = publisher = None

    def on_started(port: int) -> None:
        nonlocal registration, publisher
        if config.redis_url:
            host = config.server.host
            address = config.advertise or (
                f"{socket.gethostname() if host in ('0.0.0.0', '::') else host}:{port}")
            client = aioredis.Redis.from_url(config.redis_url, socket_timeout=5)
            registration = Registration(client, role, address,
                                        lambda: replica_load(engine, config))
            registration.start()
            if engine.caches.prefix is not None:
                publisher = IndexPublisher(client, role, address, engine.caches.prefix)
                publisher.start()

    async def on_stop() -> None:
        if registration is not None:
            await registration.stop()
        if publisher is not None:
            await publisher.stop()
        engine.close()
        telemetry.shutdown()

    watching: list[asyncio.Task] = []

    def on_health(health) -> None:
        runner = getattr(engine, "runner", None)  # (an n-gram drafter has no model thread)
        if runner is not None and config.stall_s > 0:
            watch = StallWatch(lambda: runner.pass_started, health, [service_name],
                               config.stall_s)
            watching.append(asyncio.get_running_loop().create_task(watch.run()))

    asyncio.run(serve(config.server, register, [service_name], on_started=on_started,
                      on_stop=on_stop, interceptors=telemetry.server_interceptors(),
                      require_client_cert=True, on_health=on_health, drain=drain))

