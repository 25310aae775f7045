"""A span and metrics per HTTP request, as the gRPC API has through its interceptor: a
server span (the engine's specmesh.generate span is its child) ended when the response's
last byte is sent, so a stream's span covers the whole stream."""

from __future__ import annotations

import time

from opentelemetry import metrics as metrics_api
from opentelemetry import trace

_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ready")
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Observe:
    """Pure ASGI middleware (no buffering of streamed bodies)."""

    def __init__(self, app, tracer: trace.Tracer, meter: metrics_api.Meter) -> None:
        self.app, self.tracer = app, tracer
        self.requests = meter.create_counter(
            "specmesh.http.requests", unit="{request}",
            description="HTTP API requests, by route and status code")
        self.duration = meter.create_histogram(
            "specmesh.http.request.duration", unit="s",
            description="HTTP API request time, to the last byte of the response (a whole "
                        "stream)", explicit_bucket_boundaries_advisory=_BUCKETS)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in _ROUTES else (
            "/v1/sessions/{session_id}" if path.startswith("/v1/sessions/") else "other")
        method = scope["method"]
        span = self.tracer.start_span(f"{method} {route}", kind=trace.SpanKind.SERVER,
                                      attributes={"http.request.method": method,
                                                  "http.route": route, "url.path": path})
        status = 500
        started = time.perf_counter()

        async def observed_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            with trace.use_span(span, end_on_exit=False, record_exception=True,
                                set_status_on_exception=True):
                await self.app(scope, receive, observed_send)
        finally:
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(trace.Status(trace.StatusCode.ERROR, f"HTTP {status}"))
            span.end()
            labels = {"http.route": route, "http.request.method": method,
                      "http.response.status_code": status}
            self.requests.add(1, labels)
            self.duration.record(time.perf_counter() - started, labels)
