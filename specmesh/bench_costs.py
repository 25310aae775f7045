"""Cost figures of `specmesh bench`: the speedup bound of speculative decoding, how close the
measured speedup comes to it, and the per-round orchestration overhead.

Sources, snapshotted before and after every (mode, concurrency) cell and differenced:

* the drafters' and verifiers' ``GetStats`` (common.proto ``ReplicaStats``): ``forward_ms``,
  ``forward_passes``, ``batched_calls``, ``draft_tokens``, ...;
* the gateway's Prometheus endpoint: ``specmesh_round_duration_seconds``,
  ``specmesh_round_draft_compute_seconds``, ``specmesh_round_verify_compute_seconds``,
  ``specmesh_round_gateway_seconds`` (the gateway's own orchestration time per round) and
  ``specmesh_spec_cache_fanout`` (branches per prepared speculation tree) (histograms:
  ``_sum``/``_count``), ``specmesh_rounds_total`` and
  ``specmesh_pipeline_drafts_total{outcome="used"|"dropped"|"none"}`` (the speculation cache:
  a round's draft was ready and used, prepared but dropped, or not prepared).

A figure whose inputs are missing or zero (a service that does not record it yet, a gateway
version that does not export the series, a remote mesh without addresses) is None, shown as
"n/a".
"""

from __future__ import annotations

import urllib.request

from gateway.adaptive import expected_tokens

STAT_FIELDS = ("calls", "fresh_prefills", "fed_tokens", "draft_tokens", "accepted_tokens",
               "forward_ms", "forward_passes", "batched_calls", "prefix_lookup_tokens",
               "prefix_hit_tokens")
GATEWAY_SERIES = {  # our key: (Prometheus sample name, required labels)
    "round_s": ("specmesh_round_duration_seconds_sum", {}),
    "round_count": ("specmesh_round_duration_seconds_count", {}),
    "draft_compute_s": ("specmesh_round_draft_compute_seconds_sum", {}),
    "verify_compute_s": ("specmesh_round_verify_compute_seconds_sum", {}),
    "rounds": ("specmesh_rounds_total", {}),
    "pipeline_used": ("specmesh_pipeline_drafts_total", {"outcome": "used"}),
    "pipeline_dropped": ("specmesh_pipeline_drafts_total", {"outcome": "dropped"}),
    "pipeline_none": ("specmesh_pipeline_drafts_total", {"outcome": "none"}),
    "gateway_s": ("specmesh_round_gateway_seconds_sum", {}),
    "gateway_count": ("specmesh_round_gateway_seconds_count", {}),
    "fanout_sum": ("specmesh_spec_cache_fanout_sum", {}),
    "fanout_count": ("specmesh_spec_cache_fanout_count", {}),
}


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either is missing or den is 0."""
    if num is None or not den:
        return None
    return num / den


def speedup_bound(alpha: float, k: int, c: float, c_v: float) -> float:
    """E(α, k) / (k·c + c_v): the speedup over target-only decoding when a round costs k draft
    steps of c target steps each plus one verify pass of c_v target steps, and nothing else
    (Leviathan et al. 2023, Theorem 3.8, with the verify pass's cost c_v measured instead of
    assumed to be 1). E(α, k) = (1 − α^(k+1)) / (1 − α), gateway.adaptive.expected_tokens."""
    return expected_tokens(alpha, k) / (k * c + c_v)


def efficiency(observed_speedup: float | None, bound: float | None) -> float | None:
    """observed speedup / bound: 1 means the serving path adds nothing to the model compute."""
    return ratio(observed_speedup, bound)


def overhead_per_round(round_s: float | None, draft_s: float | None, verify_s: float | None,
                       rounds: float | None) -> tuple[float | None, float | None]:
    """(ms per round, fraction of round time) of a round's wall time that is neither drafter nor
    verifier model compute: gRPC, serialization, Python, Redis, queueing. Inputs are sums over
    the same rounds (seconds) and the round count."""
    if None in (round_s, draft_s, verify_s) or not rounds or not round_s:
        return None, None
    rest = round_s - draft_s - verify_s
    return rest / rounds * 1000.0, rest / round_s


def cache_hit(used: float | None, dropped: float | None, none: float | None) -> float | None:
    """The speculation cache's hit rate: rounds whose draft was ready and used / rounds counted
    (used + dropped + none); a counter not exported yet counts 0 when another one is."""
    counts = (used, dropped, none)
    if all(x is None for x in counts):
        return None
    return ratio(used or 0.0, sum(x or 0.0 for x in counts))


def gateway_figures(gateway: dict | None) -> dict:
    """A cell's gateway figures from its Prometheus deltas (``ServiceProbe.delta``'s "gateway"):
    ``cache_hit`` and ``cache_rounds`` (the drafter-tier drafting rounds it counts),
    ``fanout`` (mean branches per prepared speculation tree) and ``gateway_ms_per_round`` (the
    gateway's orchestration time per round); None where a series is absent or counted
    nothing."""
    g = gateway or {}
    gateway_s = ratio(g.get("gateway_s"), g.get("gateway_count"))
    counts = [g.get(f"pipeline_{x}") for x in ("used", "dropped", "none")]
    return {"cache_hit": cache_hit(*counts),
            "cache_rounds": (None if all(x is None for x in counts)
                             else sum(x or 0.0 for x in counts)),
            "fanout": ratio(g.get("fanout_sum"), g.get("fanout_count")),
            "gateway_ms_per_round": None if gateway_s is None else gateway_s * 1000.0}


# --- snapshots of the services --------------------------------------------------------------


def _stub(address: str, kind: str):
    import grpc

    from specmesh.v1 import drafter_pb2_grpc, verifier_pb2_grpc

    channel = grpc.insecure_channel(address)
    cls = verifier_pb2_grpc.VerifierStub if kind == "verifier" else drafter_pb2_grpc.DrafterStub
    return channel, cls(channel)


def model_info(address: str, kind: str, timeout: float = 10.0):
    """The replica's ModelInfo (kind: "verifier" or "drafter")."""
    from specmesh.v1 import common_pb2

    channel, stub = _stub(address, kind)
    with channel:
        return stub.GetModelInfo(common_pb2.ModelInfoRequest(), timeout=timeout)


def replica_stats(address: str, kind: str, timeout: float = 10.0) -> dict:
    from specmesh.v1 import common_pb2

    channel, stub = _stub(address, kind)
    with channel:
        s = stub.GetStats(common_pb2.StatsRequest(), timeout=timeout)
    return {f: getattr(s, f) for f in STAT_FIELDS}


def parse_gateway_metrics(text: str) -> dict:
    """Our GATEWAY_SERIES keys from a Prometheus exposition; None for a series not exported
    (yet: histograms and counters appear once first recorded)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float | None] = dict.fromkeys(GATEWAY_SERIES)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for key, (name, labels) in GATEWAY_SERIES.items():
                if sample.name == name and all(sample.labels.get(k) == v
                                               for k, v in labels.items()):
                    out[key] = (out[key] or 0.0) + sample.value
    return out


class ServiceProbe:
    """Reads every counter the cost figures need; ``snapshot()`` before and after a cell,
    ``delta()`` of the two. Addresses it cannot reach give None, not an error."""

    def __init__(self, verifiers: list[str], drafters: list[str], metrics_url: str = "") -> None:
        self.verifiers = list(verifiers)
        self.metrics_url = metrics_url
        self.drafters: dict[str, list[str]] = {"model": [], "ngram": []}
        for address in drafters:
            try:
                kind = model_info(address, "drafter").kind or "model"
            except Exception:  # unreachable: its figures are n/a
                continue
            self.drafters.setdefault(kind, []).append(address)

    def _sum(self, addresses: list[str], kind: str) -> dict | None:
        total = None
        for address in addresses:
            try:
                s = replica_stats(address, kind)
            except Exception:
                return None
            total = s if total is None else {f: total[f] + s[f] for f in STAT_FIELDS}
        return total

    def snapshot(self) -> dict:
        gateway = None
        if self.metrics_url:
            try:
                with urllib.request.urlopen(self.metrics_url, timeout=10) as reply:
                    gateway = parse_gateway_metrics(reply.read().decode())
            except OSError:
                gateway = None
        return {"verifier": self._sum(self.verifiers, "verifier"),
                "drafter_model": self._sum(self.drafters["model"], "drafter"),
                "drafter_ngram": self._sum(self.drafters["ngram"], "drafter"),
                "gateway": gateway}

    @staticmethod
    def delta(before: dict, after: dict) -> dict:
        out = {}
        for part, b in before.items():
            a = after.get(part)
            if a is None or b is None:
                out[part] = None
            else:
                # a gateway series absent before and present after was first recorded in
                # between: it was 0 before
                out[part] = {f: (None if a[f] is None else a[f] - (b[f] or 0)) for f in a}
        return out


def _get(d: dict | None, *path):
    for key in path:
        if d is None:
            return None
        d = d.get(key)
    return d


def cost_figures(target_row: dict, spec_row: dict, k: int, drafter: str) -> dict:
    """The cost figures of one speculative row against the target-only row of the same
    concurrency (both with their ``services`` deltas; ``vs_target``, its tokens/s over the
    target-only row's, and ``alpha`` filled in). k = 0: the gateway's default, no bound.

    t = verifier forward_ms / forward_passes in the target-only row (one target step);
    c = (drafter forward_ms / drafted tokens) / t, 0 for the prompt-lookup drafter (no model);
    c_v = (verifier forward_ms / forward_passes in the speculative row) / t;
    bound = E(α, k) / (k·c + c_v); efficiency = observed speedup over target-only / bound."""
    ts, ss = target_row.get("services"), spec_row.get("services")
    t = ratio(_get(ts, "verifier", "forward_ms"), _get(ts, "verifier", "forward_passes"))
    if drafter == "ngram":
        c = 0.0 if _get(ss, "drafter_ngram", "draft_tokens") else None
    else:
        per_token = ratio(_get(ss, "drafter_model", "forward_ms"),
                          _get(ss, "drafter_model", "draft_tokens"))
        c = ratio(per_token, t)
    verify_ms = ratio(_get(ss, "verifier", "forward_ms"), _get(ss, "verifier", "forward_passes"))
    c_v = ratio(verify_ms, t)
    alpha = spec_row.get("alpha")
    bound = expected = None
    if alpha is not None and k > 0:
        expected = expected_tokens(alpha, k)
        if c is not None and c_v is not None:
            bound = speedup_bound(alpha, k, c, c_v)
    g = _get(ss, "gateway")
    over_ms, over_frac = overhead_per_round(_get(g, "round_s"), _get(g, "draft_compute_s"),
                                            _get(g, "verify_compute_s"), _get(g, "round_count"))
    observed = spec_row.get("vs_target")
    return {
        "mode": spec_row["mode"], "label": spec_row["label"],
        "concurrency": spec_row["concurrency"], "k": k, "alpha": alpha,
        "target_step_ms": t, "c": c, "c_v": c_v, "verify_pass_ms": verify_ms,
        "expected_tokens_per_round": expected,
        "observed_tokens_per_round": spec_row.get("tokens_per_round"),
        "bound": bound, "vs_target": observed, "efficiency": efficiency(observed, bound),
        "overhead_ms_per_round": over_ms, "overhead_fraction": over_frac,
        **gateway_figures(g),
    }
