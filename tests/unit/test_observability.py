"""The observability pieces alone: a request's record into metrics and spans, the stage
lines' JSON form, and when tracing is on."""

from __future__ import annotations

import io
import logging
import time
from typing import Any

import orjson
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from ext_proc.observability.metrics import ChunkHistogram
from ext_proc.observability.request import Observability
from ext_proc.observability.stage_log import STAGE_LOGGER, JsonFormatter, stage
from ext_proc.observability.tracing import tracer_from_environment, tracer_with


def _samples(observability: Observability) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = observability.metrics.exposition().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_finished_request_is_counted_by_status_code_and_its_chunks_by_duration() -> None:
    observability = Observability()
    record = observability.begin("r1")
    record.headers("chat", {})
    record.resolved("tiny-lora")  # an adapter's request: counted under its name
    started = time.perf_counter() - 0.003  # a 3 ms chunk: the 4.096 ms bucket, not the 2.048 ms one
    record.derendered(started)
    record.answered(200)
    record.chunk(end=True)
    record.finish()
    failed = observability.begin("r2")
    failed.headers("completions", {})
    failed.answered(429, "token_budget_exceeded", end=True)
    failed.finish()
    samples = _samples(observability)
    assert (
        samples[("tito_requests_total", (("api", "chat"), ("code", ""), ("model", "tiny-lora"), ("status", "200")))]
        == 1
    )
    key = (  # refused before its model was known
        "tito_requests_total",
        (("api", "completions"), ("code", "token_budget_exceeded"), ("model", ""), ("status", "429")),
    )
    assert samples[key] == 1
    buckets = {labels[0][1]: v for (name, labels), v in samples.items() if name == "tito_derender_chunk_seconds_bucket"}
    assert buckets[repr(ChunkHistogram.BOUNDS_S[11])] == 0 and buckets[repr(ChunkHistogram.BOUNDS_S[12])] == 1
    assert buckets["+Inf"] == 1
    # TTFT only for an answer that was not an error
    assert samples[("tito_time_to_first_token_seconds_count", (("api", "chat"),))] == 1
    assert ("tito_time_to_first_token_seconds_count", (("api", "completions"),)) not in samples


def test_a_client_gone_before_the_end_is_a_cancellation() -> None:
    observability = Observability()
    record = observability.begin("r3")
    record.headers("chat", {})
    record.answered(200)
    record.chunk(end=False)
    record.finish(cancelled=not record.complete)
    samples = _samples(observability)
    assert samples[("tito_cancellations_total", (("api", "chat"),))] == 1


def test_spans_join_the_clients_trace_and_hand_the_engine_a_child_context() -> None:
    exporter = InMemorySpanExporter()
    observability = Observability(tracer=tracer_with(exporter, batch=False))
    record = observability.begin("r4")
    record.headers("chat", {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    headers = record.leg("lease-1", ("10.0.0.7:8200",))
    record.answered(200, end=True)
    record.finish()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert sorted(spans) == ["generate", "tito chat"]
    generate = spans["generate"]
    assert headers == {"traceparent": f"00-4bf92f3577b34da6a3ce929d0e0e4736-{generate.context.span_id:016x}-01"}
    assert generate.parent.span_id == spans["tito chat"].context.span_id
    assert spans["tito chat"].parent.span_id == 0x00F067AA0BA902B7


def test_tracing_is_off_without_an_endpoint() -> None:
    assert tracer_from_environment(None, environ={}) is None
    assert tracer_from_environment("http://collector:4317", environ={"OTEL_SDK_DISABLED": "true"}) is None
    assert tracer_from_environment(None, environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}) is not None


def test_a_stage_line_in_json_carries_the_request_id_and_its_fields_as_keys() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    STAGE_LOGGER.addHandler(handler)
    STAGE_LOGGER.setLevel(logging.INFO)
    try:
        stage("retry", "abc123", logging.WARNING, failed="10.0.0.7:8200", served_by="10.0.0.8:8200")
    finally:
        STAGE_LOGGER.removeHandler(handler)
    line = orjson.loads(out.getvalue())
    assert {k: line[k] for k in ("level", "logger", "stage", "request_id", "failed", "served_by")} == {
        "level": "warning",
        "logger": "tito.stage",
        "stage": "retry",
        "request_id": "abc123",
        "failed": "10.0.0.7:8200",
        "served_by": "10.0.0.8:8200",
    }


def test_a_stage_line_is_logged_without_looking_up_its_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    """No format prints the caller's file and line, and finding them walks a request task's
    whole stack: a stage line never asks for them."""

    def walked(*_: Any, **__: Any) -> Any:
        raise AssertionError("the caller was looked up")

    monkeypatch.setattr(logging.Logger, "findCaller", walked)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    STAGE_LOGGER.addHandler(handler)
    STAGE_LOGGER.setLevel(logging.INFO)
    try:
        stage("leg", "abc123", instance="10.0.0.7:8200", role="union")
    finally:
        STAGE_LOGGER.removeHandler(handler)
    assert out.getvalue() == "INFO tito.stage: leg request=abc123 instance=10.0.0.7:8200 role=union\n"
