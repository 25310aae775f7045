"""Traces and metrics from three separate service processes.

The test runs its own OTLP/gRPC receiver (the collector service definitions from the
opentelemetry-proto package; no collector binary is available here), points the services
at it with the standard OTEL_EXPORTER_OTLP_ENDPOINT variable, and scrapes every
service's Prometheus endpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from services.local_mesh import free_port
from specmesh.client import GatewayClient, build_request
from tests.conftest import launch


class Receiver(trace_service_pb2_grpc.TraceServiceServicer,
               metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []  # (service.name, Span)
        self.lock = threading.Lock()

    def Export(self, request, context):
        if isinstance(request, metrics_service_pb2.ExportMetricsServiceRequest):
            return metrics_service_pb2.ExportMetricsServiceResponse()
        with self.lock:
            for rs in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    self.spans.extend((attrs.get("service.name", ""), s) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def receiver():
    server = grpc.server(futures.ThreadPoolExecutor(4))
    rec = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(rec, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield rec, port
    server.stop(0)


@pytest.fixture(scope="module")
def traced_mesh(tiny_pair, redis_url, receiver, tmp_path_factory):
    _, port = receiver
    ports = {tier: free_port() for tier in ("gateway", "drafter", "verifier")}
    env = (("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}"),
           ("OTEL_EXPORTER_OTLP_INSECURE", "true"), ("OTEL_BSP_SCHEDULE_DELAY", "100"),
           ("OTEL_METRIC_EXPORT_INTERVAL", "60000"))
    # --no-pipeline: the exact per-call accounting below counts one draft call per round;
    # pipelined drafting (tests/test_pipeline.py) also drafts ahead.
    m = launch(tiny_pair, redis_url, tmp_path_factory.mktemp("traced-logs"), env=env,
               extra_gateway_args=("--metrics-port", str(ports["gateway"]), "--no-pipeline"),
               extra_drafter_args=("--metrics-port", str(ports["drafter"])),
               extra_verifier_args=("--metrics-port", str(ports["verifier"])))
    yield m, ports
    m.stop()


def _attr(span, key):
    for a in span.attributes:
        if a.key == key:
            v = a.value
            return {"int_value": v.int_value, "string_value": v.string_value,
                    "double_value": v.double_value, "bool_value": v.bool_value}.get(
                v.WhichOneof("value"))
    return None


def test_one_trace_spans_all_three_tiers_round_by_round(traced_mesh, receiver):
    mesh, _ = traced_mesh
    rec, _ = receiver
    with GatewayClient(mesh.gateway_address) as client:
        chunks = list(client.stream(build_request("def fibonacci(n):", max_new_tokens=24,
                                                  num_draft_tokens=3)))
    usage = chunks[-1].usage
    deadline = time.monotonic() + 20
    while True:
        with rec.lock:
            gen = [s for name, s in rec.spans if s.name == "specmesh.generate"
                   and _attr(s, "specmesh.session_id") == chunks[0].session_id]
            if gen:
                trace_id = gen[0].trace_id
                in_trace = [(n, s) for n, s in rec.spans if s.trace_id == trace_id]
                services = {n for n, _ in in_trace}
                rounds = [s for _, s in in_trace if s.name == "specmesh.round"]
                verifies = [s for _, s in in_trace if s.name.endswith("Verifier/Verify")
                            and s.kind == s.SPAN_KIND_SERVER]
                if len(services) == 3 and len(rounds) == usage.rounds == len(verifies):
                    break
        assert time.monotonic() < deadline, f"spans incomplete: {services if gen else 'none'}"
        time.sleep(0.2)

    assert services == {"specmesh-gateway", "specmesh-drafter", "specmesh-verifier"}
    by_id = {s.span_id: s for _, s in in_trace}

    def ancestors(span):
        while span.parent_span_id in by_id:
            span = by_id[span.parent_span_id]
            yield span

    round_ids = {s.span_id for s in rounds}
    for name, span in in_trace:
        if name in ("specmesh-drafter", "specmesh-verifier") and span.name.endswith(
                ("/Draft", "/Verify")):
            assert span.kind == span.SPAN_KIND_SERVER
            assert any(a.span_id in round_ids for a in ancestors(span)), span.name
    assert len(rounds) == usage.rounds
    assert sum(_attr(s, "specmesh.round.accepted") for s in rounds) == usage.accepted_draft_tokens
    assert sum(_attr(s, "specmesh.round.k") for s in rounds) == usage.draft_tokens
    assert all(r.parent_span_id == gen[0].span_id for r in rounds)
    assert _attr(gen[0], "gen_ai.usage.output_tokens") == usage.completion_tokens
    assert _attr(gen[0], "specmesh.rounds") == usage.rounds
    verify_spans = [s for n, s in in_trace if n == "specmesh-verifier"]
    assert {_attr(s, "specmesh.cache") for s in verify_spans} >= {"prefill", "hit"}

    # The gateway's JSON log line for this request carries the same trace id.
    log_lines = (mesh.proc("gateway").log_path.read_text().splitlines())
    entries = [json.loads(line) for line in log_lines if line.startswith("{")]
    finished = [e for e in entries if chunks[0].session_id in e["message"]]
    assert finished and finished[0]["trace_id"] == trace_id.hex()


def test_turns_of_a_session_are_linked(traced_mesh, receiver):
    mesh, _ = traced_mesh
    rec, _ = receiver
    with GatewayClient(mesh.gateway_address) as client:
        first = client.generate(build_request("import os", max_new_tokens=4, keep_session=True))
        client.generate(build_request("\n", session_id=first.session_id, max_new_tokens=4))
        client.close_session(first.session_id)
    deadline = time.monotonic() + 20
    while True:
        with rec.lock:
            gens = [s for _, s in rec.spans if s.name == "specmesh.generate"
                    and _attr(s, "specmesh.session_id") == first.session_id]
        if len(gens) == 2:
            break
        assert time.monotonic() < deadline
        time.sleep(0.2)
    gens.sort(key=lambda s: s.start_time_unix_nano)
    assert [(link.trace_id, link.span_id) for link in gens[1].links] == [
        (gens[0].trace_id, gens[0].span_id)]


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items()
                                  if k in ("position", "outcome", "finish_reason", "drafted")))
            out[(sample.name, labels)] = out.get((sample.name, labels), 0.0) + sample.value
    return out


def _total(scrape: dict, name: str) -> float:
    return sum(v for (n, _), v in scrape.items() if n == name)


def test_metrics_move_exactly_as_the_usage_says(traced_mesh):
    mesh, ports = traced_mesh
    before = {tier: _scrape(port) for tier, port in ports.items()}
    with GatewayClient(mesh.gateway_address) as client:
        reply = client.generate(build_request("class Parser:", max_new_tokens=30,
                                              num_draft_tokens=4))
    time.sleep(0.2)
    after = {tier: _scrape(port) for tier, port in ports.items()}
    u = reply.usage

    def delta(tier, name):
        return _total(after[tier], name) - _total(before[tier], name)

    assert delta("gateway", "specmesh_tokens_generated_total") == u.completion_tokens
    assert delta("gateway", "specmesh_rounds_total") == u.rounds
    # rounds without drafts: the lead round, and a last round left with a budget of one
    # token if the run came to that (k = 4 was asked for every round)
    without = (after["gateway"].get(("specmesh_rounds_total", (("drafted", "false"),)), 0.0)
               - before["gateway"].get(("specmesh_rounds_total", (("drafted", "false"),)), 0.0))
    assert without in (1, 2)
    assert delta("gateway", "specmesh_draft_tokens_proposed_total") == u.draft_tokens
    assert delta("gateway", "specmesh_draft_tokens_accepted_total") == u.accepted_draft_tokens
    assert delta("gateway", "specmesh_requests_total") == 1
    # one commit per round (a new session's prompt is written when it is created), each
    # alone in its pipeline (one request)
    assert delta("gateway", "specmesh_store_commit_batch_sum") == u.rounds
    assert delta("gateway", "specmesh_store_commit_batch_count") == u.rounds
    # The drafter also drafted the lead round's 4 tokens, verified in round two but for the
    # first (a guess of the verifier's token) when that guess held, none of them when not.
    drafted = delta("drafter", "specmesh_drafter_draft_tokens_total")
    assert drafted - u.draft_tokens in (1, 4)
    assert delta("verifier", "specmesh_verifier_draft_tokens_total") == u.draft_tokens
    assert delta("verifier", "specmesh_verifier_accepted_tokens_total") == (
        u.accepted_draft_tokens)
    assert delta("verifier", "specmesh_verifier_calls_total") == u.rounds
    # Per position: a draft is accepted only after every earlier one, so acceptance counts
    # never grow with the position, and position 0 is proposed in at most every round.
    def by_position(name):
        return [after["gateway"].get((name, (("position", str(i)),)), 0)
                - before["gateway"].get((name, (("position", str(i)),)), 0) for i in range(4)]

    accepted = by_position("specmesh_draft_tokens_accepted_total")
    proposed = by_position("specmesh_draft_tokens_proposed_total")
    assert sum(proposed) == u.draft_tokens and sum(accepted) == u.accepted_draft_tokens
    assert accepted == sorted(accepted, reverse=True)
    assert proposed == sorted(proposed, reverse=True) and proposed[0] <= u.rounds
    assert _total(after["verifier"], "specmesh_kv_cache_capacity_bytes") > 0
    assert "gen_ai_server_time_to_first_token_seconds_count" in {n for n, _ in after["gateway"]}


def test_dashboard_and_docs_name_only_metrics_that_exist(traced_mesh):
    """Every metric the Grafana dashboard and docs/observability.md query is exported, once
    the mesh has served a drafting request (a histogram or a labelled counter is exported
    from its first sample: the test serves its own, so it holds alone as in its module)."""
    import re
    from pathlib import Path

    mesh, ports = traced_mesh
    with GatewayClient(mesh.gateway_address) as client:
        client.generate(build_request("class Parser:", max_new_tokens=12, num_draft_tokens=3))
    time.sleep(0.2)
    exported = {name for port in ports.values() for name, _ in _scrape(port)}
    root = Path(__file__).resolve().parent.parent
    text = (root / "docs/grafana/specmesh.json").read_text()
    text += (root / "docs/observability.md").read_text().split("## PromQL")[1]
    queried = set(re.findall(r"\b((?:specmesh|gen_ai)_[a-z_]+)\b", text))
    assert queried, "no metric found in the dashboard"
    assert sorted(queried - exported) == []


def test_no_tracing_cost_without_an_exporter():
    """Without an OTLP endpoint no span is recorded and no gRPC interceptor runs on any hop;
    with one, both are there. Run in fresh interpreters: setup() installs global providers."""
    probe = ("from services.telemetry import TelemetryConfig, setup\n"
             "import os\n"
             "t = setup(TelemetryConfig(service='verifier', log_format='text',"
             " env=dict(os.environ)))\n"
             "span = t.tracer.start_span('x')\n"
             "print(t.tracing, len(t.server_interceptors()), len(t.client_interceptors()),"
             " span.is_recording())\n")

    def run(env: dict) -> str:
        return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              timeout=60, env=env, check=True).stdout.split()

    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    assert run(base) == ["False", "0", "0", "False"]
    traced = run(dict(base, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9"))
    assert traced[0] == "True" and int(traced[1]) >= 1 and int(traced[2]) >= 1
    assert traced[3] == "True"


def test_a_round_under_an_unrecorded_request_starts_no_span_and_logs_the_requests_ids():
    """Round spans (gateway/telemetry.py): under a recorded request span the round span is a
    recorded child; under one that is not recorded (no exporter: the sampler is off) no
    span is started, and the round's context is the request's (its log lines carry the
    request's trace and span ids)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON

    from gateway.telemetry import RequestTelemetry

    class Req:
        class rounds:  # noqa: N801 - the attribute a round span reads (its index)
            index = 3

    for sampler, recorded in ((ALWAYS_ON, True), (ALWAYS_OFF, False)):
        tracer = TracerProvider(sampler=sampler).get_tracer("test")
        telemetry = RequestTelemetry(tracer, metrics=None, model="m")
        request_span = tracer.start_span("specmesh.generate")
        round_span = telemetry.round_span(request_span, Req, k=2)
        assert round_span.is_recording() is recorded
        parent, child = request_span.get_span_context(), round_span.get_span_context()
        assert child.trace_id == parent.trace_id and parent.trace_id != 0
        if recorded:
            assert child.span_id != parent.span_id and round_span.parent.span_id == parent.span_id
        else:
            assert child.span_id == parent.span_id
