"""The gateway's per-request telemetry: the request span, round spans, and the metrics
they feed (docs/observability.md lists every name)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, TraceFlags

from gateway.round_result import RoundResult
from services.metrics import GatewayMetrics

if TYPE_CHECKING:
    from gateway.chunks import Finish
    from gateway.session_rounds import RequestState

log = logging.getLogger(__name__)


class RequestTelemetry:
    def __init__(self, tracer: trace.Tracer, metrics: GatewayMetrics, model: str) -> None:
        self.tracer = tracer
        self.metrics = metrics
        self.model = model

    def generate_span(self, req: RequestState) -> trace.Span:
        """The request's span; it links to the previous turn of the session, if any."""
        spec, h = req.spec, req.handle
        links = []
        if h.last_trace:
            trace_id, span_id = (int(x, 16) for x in h.last_trace.split("-"))
            links.append(Link(SpanContext(trace_id, span_id, is_remote=True,
                                          trace_flags=TraceFlags(TraceFlags.SAMPLED))))
        span = self.tracer.start_span("specmesh.generate", links=links, attributes={
            "gen_ai.operation.name": "text_completion",
            "gen_ai.request.model": self.model,
            "gen_ai.request.max_tokens": spec.max_new_tokens,
            "gen_ai.request.temperature": spec.params.temperature,
            "gen_ai.request.top_p": spec.params.top_p,
            "gen_ai.request.top_k": spec.params.top_k,
            "gen_ai.usage.input_tokens": req.usage.prompt_tokens,
            "specmesh.session_id": h.session_id,
            "specmesh.speculate": spec.speculate,
        })
        ctx = span.get_span_context()
        h.last_trace = f"{ctx.trace_id:032x}-{ctx.span_id:016x}"
        return span

    def round_span(self, parent: trace.Span, req: RequestState, k: int) -> trace.Span:
        """The round's span; under a request span that is not recorded (no trace exporter,
        or not sampled) none is recorded either, and the round's log lines carry the
        request's trace and span ids: the SDK's start_span of a span that is dropped anyway
        took ~7% of the gateway's event loop at 16 streams (docs/performance.md)."""
        if not parent.is_recording():
            return NonRecordingSpan(parent.get_span_context())
        return self.tracer.start_span(
            "specmesh.round", context=trace.set_span_in_context(parent),
            attributes={"specmesh.round.index": req.rounds.index, "specmesh.round.k": k})

    def record_round(self, span: trace.Span, req: RequestState, r: RoundResult, kept: int,
                      seconds: float) -> None:
        h = req.handle
        network = (r.draft_ms - r.draft_compute_ms) + (r.verify_ms - r.verify_compute_ms)
        span.set_attributes({
            "specmesh.round.k": len(r.drafted),  # verified: a lead round none, as it turned out
            "specmesh.round.accepted": r.num_accepted,
            "specmesh.round.first_rejection": (r.num_accepted if r.num_accepted < len(r.drafted)
                                               else -1),
            "specmesh.round.tokens": kept,
            "specmesh.drafter": h.drafter.replica if r.drafted else "",
            "specmesh.verifier": h.verifier.replica,
            "specmesh.round.draft_ms": r.draft_ms,
            "specmesh.round.verify_ms": r.verify_ms,
            "specmesh.round.network_ms": network,
            "specmesh.round.pipeline": r.pipeline,
        })
        self.metrics.round(len(r.drafted), r.num_accepted, kept, seconds)
        self.metrics.draft_compute.record(r.draft_compute_ms / 1000.0)
        self.metrics.verify_compute.record(r.verify_compute_ms / 1000.0)
        if r.pipeline:
            self.metrics.pipelined.add(1, {"outcome": r.pipeline})
        if r.prefetch is not None:
            self.metrics.fanout.record(len(r.prefetch.branches))
        self.metrics.gateway_time.record(max(0.0, seconds - r.waited_ms / 1000.0))
        now = time.perf_counter()
        if not req.first_token_at:
            req.first_token_at = now
            self.metrics.ttft.record(now - req.started)

    def record_finish(self, span: trace.Span, req: RequestState, finish: Finish) -> None:
        u = req.usage
        span.set_attributes({
            "gen_ai.usage.output_tokens": u.completion_tokens,
            "gen_ai.response.finish_reasons": [finish.name.lower()],
            "specmesh.rounds": u.rounds,
            "specmesh.draft_tokens": u.draft_tokens,
            "specmesh.accepted_draft_tokens": u.accepted_draft_tokens,
            "specmesh.acceptance_rate": (u.accepted_draft_tokens / u.draft_tokens
                                         if u.draft_tokens else 0.0),
        })
        self.metrics.requests.add(1, {"finish_reason": finish.name.lower()})
        with trace.use_span(span):
            log.info("request finished: session %s, %d prompt + %d completion tokens, %d rounds, "
                     "%d/%d drafts accepted, finish %s", req.handle.session_id, u.prompt_tokens,
                     u.completion_tokens, u.rounds, u.accepted_draft_tokens, u.draft_tokens,
                     finish.name.lower())
        if u.completion_tokens > 1:
            self.metrics.itl.record((time.perf_counter() - req.first_token_at)
                                    / (u.completion_tokens - 1))
