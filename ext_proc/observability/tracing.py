"""OpenTelemetry traces: off unless the standard OTEL_* variables name an exporter endpoint.

With tracing on, each request is one span joined to the client's `traceparent`, with child
spans for render, schedule, each engine leg (whose context goes to the engine as its
`traceparent`: vLLM joins it) and derender (one span per stream, its chunks aggregated: a span
per chunk would cost more than the derender). Spans are made with explicit times after the
fact, so the hot path only takes timestamps. Export is batched on the SDK's own thread.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("tito.tracing")
PROPAGATOR = TraceContextTextMapPropagator()
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def tracer_from_environment(collector: str | None = None, environ: Mapping[str, str] = os.environ) -> Tracer | None:
    """The OTLP exporter the OTEL_* variables describe (gRPC unless OTEL_EXPORTER_OTLP_PROTOCOL
    says http/protobuf), else one to `collector` (the config's, gRPC), else None: tracing off,
    no span is ever made."""
    if environ.get("OTEL_SDK_DISABLED") == "true":
        return None
    exporter: SpanExporter
    if any(environ.get(name) for name in ENDPOINT_VARIABLES):
        if environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc").startswith("http"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

            exporter = HttpExporter()
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

            exporter = GrpcExporter()
    elif collector is not None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        exporter = GrpcExporter(endpoint=collector, insecure=True)
    else:
        return None
    log.info("tracing on: OTLP exporter %s", type(exporter).__module__)
    return tracer_with(exporter)


def tracer_with(exporter: SpanExporter, batch: bool = True) -> Tracer:
    """A tracer exporting to `exporter` (tests pass an in-memory one)."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    service = os.environ.get("OTEL_SERVICE_NAME", "tito-processor")
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
    return provider.get_tracer("tito")


def request_span(tracer: Tracer, name: str, headers: Mapping[str, str], start_ns: int) -> Span:
    """The request's span, a child of the client's `traceparent` when it sent one."""
    parent = PROPAGATOR.extract(headers)
    return tracer.start_span(name, context=parent, kind=SpanKind.SERVER, start_time=start_ns)


def child_span(tracer: Tracer, parent: Span, name: str, start_ns: int, kind: SpanKind = SpanKind.INTERNAL) -> Span:
    return tracer.start_span(name, context=set_span_in_context(parent), kind=kind, start_time=start_ns)


def traceparent(span: Span) -> dict[str, str]:
    """The headers that make an engine's work a child of `span`."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=set_span_in_context(span))
    return carrier
