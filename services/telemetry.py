"""One telemetry setup for the three services: traces, metrics and JSON logs.

Traces and metrics go out over OTLP when the standard ``OTEL_EXPORTER_OTLP_*``
variables name a collector (the SDK reads them, and ``OTEL_TRACES_SAMPLER``,
``OTEL_RESOURCE_ATTRIBUTES``, ...), and nowhere otherwise. Metrics are also served
for Prometheus on ``--metrics-port``. W3C trace context crosses the gRPC hops
through opentelemetry-instrumentation-grpc's interceptors, never by hand.

Without a trace exporter nothing would ever read a span, so none is recorded (the tracer
samples nothing) and the gRPC interceptors are left out: a round then pays nothing for
tracing. With one, every hop is traced as before.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from opentelemetry import metrics, trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

from services.errors import StartupError

VERSION = "0.1.0"
_OTLP_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
              "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")


@dataclass(frozen=True)
class TelemetryConfig:
    service: str  # "gateway", "drafter" or "verifier"
    metrics_port: int = 0  # 0 = no Prometheus endpoint
    log_format: str = "json"  # "json" or "text"
    log_level: str = "info"
    env: Mapping[str, str] = field(default_factory=dict)  # the OTEL_* environment, read by the CLI

    def __post_init__(self) -> None:
        if self.log_format not in ("json", "text"):
            raise ValueError(f"log format must be json or text, got {self.log_format!r}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics port must be in 0..65535, got {self.metrics_port}")

    @property
    def otlp(self) -> bool:
        return any(self.env.get(name) for name in _OTLP_VARS)


@dataclass
class Telemetry:
    tracer_provider: TracerProvider
    meter_provider: MeterProvider
    tracer: trace.Tracer
    meter: metrics.Meter
    tracing: bool = True  # spans are exported: record them and carry context across hops

    def server_interceptors(self) -> list:
        if not self.tracing:
            return []
        return [aio_server_interceptor(tracer_provider=self.tracer_provider)]

    def client_interceptors(self) -> list:
        if not self.tracing:
            return []
        return list(aio_client_interceptors(tracer_provider=self.tracer_provider))

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def setup(config: TelemetryConfig) -> Telemetry:
    """Builds the providers (also installed as the global ones) and configures logging."""
    resource = Resource.create({
        "service.name": f"specmesh-{config.service}",
        "service.namespace": "specmesh",
        "service.instance.id": f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
        "service.version": VERSION,
    })
    # No exporter: sample nothing, so spans are non-recording and cost next to nothing.
    tracer_provider = (TracerProvider(resource=resource) if config.otlp else
                       TracerProvider(resource=resource, sampler=ALWAYS_OFF))
    readers = []
    if config.otlp:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    if config.metrics_port:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server

        try:
            start_http_server(config.metrics_port)
        except OSError as exc:
            raise StartupError(f"cannot serve metrics on port {config.metrics_port}: "
                               f"{exc.strerror or exc} (pick another --metrics-port)") from exc
        readers.append(PrometheusMetricReader())
    meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)
    configure_logging(config.log_level, config.log_format)
    return Telemetry(tracer_provider=tracer_provider, meter_provider=meter_provider,
                     tracer=tracer_provider.get_tracer("specmesh", VERSION),
                     meter=meter_provider.get_meter("specmesh", VERSION),
                     tracing=config.otlp)


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with the current span's trace_id and span_id."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record), "level": record.levelname,
                 "logger": record.name, "message": record.getMessage()}
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            entry["trace_id"] = format(ctx.trace_id, "032x")
            entry["span_id"] = format(ctx.span_id, "016x")
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
