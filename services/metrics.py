"""The metrics each tier exports (OTel metrics API; Prometheus names replace dots by
underscores and add ``_total`` to counters). docs/observability.md lists them all."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                    5.0, 10.0)


def _gauge(meter: metrics.Meter, name: str, unit: str, description: str,
           read: Callable[[], float]) -> None:
    def callback(_: CallbackOptions):
        yield Observation(read())

    meter.create_observable_gauge(name, callbacks=[callback], unit=unit, description=description)


def _counter(meter: metrics.Meter, name: str, unit: str, description: str,
             read: Callable[[], int]) -> None:
    def callback(_: CallbackOptions):
        yield Observation(read())

    meter.create_observable_counter(name, callbacks=[callback], unit=unit,
                                    description=description)


def _labelled(read: Callable[[], Iterable[tuple[float, dict]]]):
    """An observable instrument's callback: one value per label set that ``read`` yields."""
    def callback(_: CallbackOptions):
        for value, labels in read():
            yield Observation(value, labels)
    return callback


def _gauges(meter: metrics.Meter, name: str, unit: str, description: str,
            read: Callable[[], Iterable[tuple[float, dict]]]) -> None:
    meter.create_observable_gauge(name, callbacks=[_labelled(read)], unit=unit,
                                  description=description)


def _counters(meter: metrics.Meter, name: str, unit: str, description: str,
              read: Callable[[], Iterable[tuple[float, dict]]]) -> None:
    meter.create_observable_counter(name, callbacks=[_labelled(read)], unit=unit,
                                    description=description)


class GatewayMetrics:
    def __init__(self, meter: metrics.Meter, active_sessions: Callable[[], int],
                 switches: Callable[[], Iterable[tuple[str, int, object]]] = tuple,
                 trees: Callable[[], object | None] = lambda: None) -> None:
        """``switches``: (drafter kind, load level, LoadSwitch) of each load switch;
        ``trees``: the TreeSwitch of lone requests' speculation trees."""
        self.tokens = meter.create_counter(
            "specmesh.tokens.generated", unit="{token}", description="Completion tokens streamed")
        self.proposed = meter.create_counter(
            "specmesh.draft.tokens.proposed", unit="{token}",
            description="Draft tokens proposed, by draft position (0-based)")
        self.accepted = meter.create_counter(
            "specmesh.draft.tokens.accepted", unit="{token}",
            description="Draft tokens accepted, by draft position (0-based)")
        self.rounds = meter.create_counter("specmesh.rounds", unit="{round}",
                                           description="Draft -> verify rounds")
        self.requests = meter.create_counter("specmesh.requests", unit="{request}",
                                             description="Finished requests, by finish reason")
        self.round_duration = meter.create_histogram(
            "specmesh.round.duration", unit="s", description="Wall time of one round",
            explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS)
        self.draft_compute = meter.create_histogram(
            "specmesh.round.draft_compute", unit="s",
            description="Drafter model compute of one round (0 when its draft was pipelined)",
            explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS)
        self.verify_compute = meter.create_histogram(
            "specmesh.round.verify_compute", unit="s",
            description="Verifier model compute of one round (its whole batched pass)",
            explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS)
        self.pipelined = meter.create_counter(
            "specmesh.pipeline.drafts", unit="{round}",
            description="Rounds by what the speculation cache held for them: used (a hit: "
                        "the committed branch was drafted during the previous verify), "
                        "dropped (a miss) or none (nothing prepared)")
        self.fanout = meter.create_histogram(
            "specmesh.spec_cache.fanout", unit="{branch}",
            description="Branches the drafter prepared during one verify",
            explicit_bucket_boundaries_advisory=[1, 2, 4, 6, 8, 12, 16, 24, 32, 64])
        self.gateway_time = meter.create_histogram(
            "specmesh.round.gateway", unit="s",
            description="Gateway work of one round: its wall time less the time spent "
                        "awaiting drafter and verifier calls (Redis commit included)",
            explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS)
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s",
            description="Time from request to its first streamed token",
            explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS)
        self.itl = meter.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s",
            description="Time per output token after the first",
            explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS)
        self.active = meter.create_up_down_counter(
            "specmesh.requests.active", unit="{request}", description="Requests in flight")
        _gauge(meter, "specmesh.sessions.active", "{session}",
               "Sessions this gateway is advancing now", active_sessions)
        self.commit_batch = meter.create_histogram(
            "specmesh.store.commit_batch", unit="{commit}",
            description="Session commits sent to Redis in one pipelined write",
            explicit_bucket_boundaries_advisory=[1, 2, 4, 8, 16, 32, 64])

        def switch_modes():
            for kind, level, switch in switches():
                yield float(switch.incumbent), {"drafter_kind": kind, "load_level": level}

        def switch_rates():
            for kind, level, switch in switches():
                for drafting, rate in switch.rate.items():
                    yield rate, {"drafter_kind": kind, "load_level": level,
                                 "drafting": "true" if drafting else "false"}

        _gauges(meter, "specmesh.load_switch.drafting", "1",
                "Whether requests under load draft (1) or not (0), per drafter kind and load "
                "level (requests in flight 2-3: 1, 4-7: 2, 8-15: 3, ...), between explorations",
                switch_modes)
        _gauges(meter, "specmesh.load_switch.rate", "{token}/s",
                "Tokens per request-second the load switch measured with and without drafts",
                switch_rates)

        def tree_mode():
            switch = trees()
            return [] if switch is None or not switch.rate else [(float(switch.incumbent), {})]

        _gauges(meter, "specmesh.spec_cache.trees", "1",
                "Whether lone requests' drafting rounds draft a speculation tree beside their "
                "verify (1) or not (0), as measured, between explorations", tree_mode)

    def round(self, proposed: int, accepted: int, kept: int, seconds: float) -> None:
        # drafted "false": a round without drafts (the fallback, a lead round, target-only)
        self.rounds.add(1, {"drafted": "true" if proposed else "false"})
        self.tokens.add(kept)
        self.round_duration.record(seconds)
        for position in range(proposed):
            self.proposed.add(1, {"position": position})
            if position < accepted:
                self.accepted.add(1, {"position": position})


class ModelServiceMetrics:
    """Drafter and verifier: work done, forward time, queue, KV cache use."""

    def __init__(self, meter: metrics.Meter, kind: str, queue_depth: Callable[[], int],
                 sessions: Callable[[], int], kv_bytes: Callable[[], int],
                 kv_capacity_bytes: Callable[[], int], prefix=None, pool=None,
                 plain=None) -> None:
        """``prefix``: the replica's PrefixCache (None: off, no prefix metrics); ``pool``: its
        model's KVPool (services/kv_slab.py; None: none, no pool metrics); ``plain``: a
        verifier's PlainThreads (services/plain_threads.py; None: off, no metrics)."""
        self.calls = meter.create_counter(f"specmesh.{kind}.calls", unit="{call}",
                                          description=f"{kind} calls answered, by outcome")
        self.draft_tokens = meter.create_counter(
            f"specmesh.{kind}.draft_tokens", unit="{token}",
            description="Tokens drafted (drafter) or draft tokens verified (verifier)")
        self.accepted_tokens = meter.create_counter(
            f"specmesh.{kind}.accepted_tokens", unit="{token}",
            description="Draft tokens accepted (verifier)")
        self.local_draft_tokens = meter.create_counter(
            f"specmesh.{kind}.local_draft_tokens", unit="{token}",
            description="Tokens the verifier's own draft model drafted (--local-drafter)")
        self.local_accepted_tokens = meter.create_counter(
            f"specmesh.{kind}.local_accepted_tokens", unit="{token}",
            description="Of those, tokens accepted")
        self.fed_tokens = meter.create_counter(
            f"specmesh.{kind}.fed_tokens", unit="{token}",
            description="Committed tokens appended to KV caches")
        self.forward = meter.create_histogram(
            f"specmesh.{kind}.forward.duration", unit="s", description="Model compute per call",
            explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS)
        self.batch_size = meter.create_histogram(
            f"specmesh.{kind}.batch_size", unit="{request}",
            description="Requests per forward pass",
            explicit_bucket_boundaries_advisory=(1, 2, 4, 8, 16, 32, 64))
        self.inflight = meter.create_up_down_counter(
            f"specmesh.{kind}.inflight", unit="{call}", description="Calls being served now")
        _gauge(meter, f"specmesh.{kind}.queue_depth", "{call}",
               "Calls waiting for or running on the model", queue_depth)
        _gauge(meter, f"specmesh.{kind}.sessions", "{session}", "Session KV caches held",
               sessions)
        _gauge(meter, "specmesh.kv_cache.used", "By", "KV cache bytes held", kv_bytes)
        _gauge(meter, "specmesh.kv_cache.capacity", "By",
               "KV cache bytes at --max-sessions full-context sessions", kv_capacity_bytes)
        if pool is not None:
            _gauge(meter, f"specmesh.{kind}.kv_pool.slots", "{slot}",
                   "KV pool slots held by session caches (a pass attends over them together)",
                   lambda: pool.in_use)
            _gauge(meter, f"specmesh.{kind}.kv_pool.capacity", "{slot}",
                   "KV pool slots at most; past them a new session takes a resting one's",
                   lambda: pool.max_slots)
        if plain is not None:
            _gauges(meter, f"specmesh.{kind}.plain_threads", "{thread}",
                    "torch threads kept for passes without drafts, per batch level (sessions "
                    "a pass 1: 1, 2-3: 2, 4-7: 3, ...), between explorations",
                    lambda: [(plain.kept(level), {"batch_level": level})
                             for level in plain.switches])
            _counters(meter, f"specmesh.{kind}.plain_passes", "{pass}",
                      "Passes without drafts run so far, by the torch threads they ran on",
                      lambda: [(n, {"threads": threads}) for threads, n in plain.passes.items()])
            _gauges(meter, f"specmesh.{kind}.draft_pass_threads", "{thread}",
                    "torch threads kept for passes that verify drafts, per batch level, "
                    "between explorations",
                    lambda: [(plain.kept(level, drafts=True), {"batch_level": level})
                             for level in plain.draft_switches])
            _counters(meter, f"specmesh.{kind}.draft_passes", "{pass}",
                      "Passes that verify drafts run so far, by the torch threads they ran on",
                      lambda: [(n, {"threads": threads})
                               for threads, n in plain.draft_passes.items()])
        if prefix is not None:
            _counter(meter, f"specmesh.{kind}.prefix.lookup_tokens", "{token}",
                     "Prompt tokens of fresh sessions looked up in the prefix cache",
                     lambda: prefix.stats.lookup_tokens)
            _counter(meter, f"specmesh.{kind}.prefix.hit_tokens", "{token}",
                     "Prompt tokens restored from the prefix cache instead of computed",
                     lambda: prefix.stats.hit_tokens)
            _counter(meter, f"specmesh.{kind}.prefix.evicted_blocks", "{block}",
                     "Prefix-cache blocks evicted, least recently used first",
                     lambda: prefix.stats.evicted_blocks)
            _gauge(meter, f"specmesh.{kind}.prefix.blocks", "{block}",
                   "Blocks the prefix cache holds now", lambda: len(prefix))
