"""One request's record: what happened to it and how long each stage took, fed to the
metrics, the trace and the stage logs. The exchange makes it; code deeper down (render,
planning, derender, relays) finds it as `current()`: the record lives in the context of the
request's own tasks, so no signature between the exchange and those stages carries it.

The hot path (`derendered`, once per client chunk) only adds numbers; spans and histograms
of per-request values are written once, when the request ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from contextvars import ContextVar

from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from ext_proc.observability import tracing
from ext_proc.observability.metrics import ChunkCounts, Metrics
from ext_proc.observability.stage_cpu import StageClock, StageProfile
from ext_proc.observability.stage_log import stage

_clock = time.perf_counter
# One derendered chunk in this many is timed (the first included): two clock reads per chunk
# cost 2-3% of an in-process derender step (`tests/bench/derender_bench.py`).
CHUNK_SAMPLE = 8
# The stage profile's stage each of Envoy's messages starts (response bodies: first or later chunks).
MESSAGE_STAGES = {
    "request_headers": "request headers",
    "request_body": "request body",
    "response_headers": "response headers",
}
_CURRENT: ContextVar[RequestRecord | None] = ContextVar("tito_request", default=None)


def current() -> RequestRecord | None:
    return _CURRENT.get()


def clock() -> StageClock | None:
    """The current request's stage clock (stage profiling off, or no request: None)."""
    record = _CURRENT.get()
    return record.clock if record is not None else None


def mark(stage: str) -> None:
    """The current request enters `stage` (`stage_cpu.STAGES`), for the stage profile."""
    if (record := _CURRENT.get()) is not None:
        record.mark(stage)


class Observability:
    """Process-wide: the metrics registry and the tracer (None: tracing off)."""

    def __init__(
        self, metrics: Metrics | None = None, tracer: Tracer | None = None, stages: StageProfile | None = None
    ) -> None:
        self.metrics = metrics or Metrics()
        self.tracer = tracer
        self.stages = stages  # CPU per request stage (`processor.profile_stages`; off: None)
        self._panicking: set[str] = set()  # pools whose panic routing was logged

    def begin(self, request_id: str) -> RequestRecord:
        """A new request's record, current in this context and the tasks it starts."""
        record = RequestRecord(self, request_id)
        _CURRENT.set(record)
        return record

    def breaker_changed(self, instance: str, state: str) -> None:
        self.metrics.breaker_transitions.labels(instance, state).inc()
        stage("breaker", "-", logging.WARNING if state == "open" else logging.INFO, instance=instance, state=state)
        if state == "closed":
            self._panicking.clear()  # a closed breaker: the next panic is news again

    def breaker_panic(self, role: str) -> None:
        """A leg routed with every breaker of its pool open: counted each time, logged once
        until a breaker closes (a line per request would flood the log)."""
        self.metrics.breaker_panics.labels(role).inc()
        if role not in self._panicking:
            self._panicking.add(role)
            stage("breaker", "-", logging.WARNING, pool=role, state="panic")

    def render_attempt(self, endpoint: str, seconds: float, outcome: str) -> None:
        """One render on one endpoint of the render pool: ok, rejected or why it failed."""
        self.metrics.render_endpoint_seconds.labels(endpoint, outcome).observe(seconds)


class RequestRecord:
    def __init__(self, observability: Observability, request_id: str) -> None:
        self._o = observability
        self.request_id = request_id
        self._start = time.perf_counter()
        self._start_ns = time.time_ns()
        self.api = "unrouted"
        self.model = ""  # what the answer is named after: a base model or an adapter (once resolved)
        self.status: int | None = None
        self.code = ""
        self.prompt_tokens = 0
        self.render_endpoint = ""  # the render pool's endpoint that rendered it
        self.render_retried = ""  # the endpoint that failed it first, and why (endpoint/reason)
        self._matched: dict[str, int] = {}  # lease -> prompt tokens its instance held
        self.completion_tokens = 0
        self.stream_interval = 1  # tokens per engine event its engine streams were asked for
        self._first_chunk: float | None = None
        self._chunks = ChunkCounts()
        self._span: Span | None = None
        self._legs: dict[str, Span] = {}
        self.complete = False  # the client got the end of its response
        self._finished = False
        self.clock = StageClock("stream open") if observability.stages is not None else None

    def mark(self, stage: str) -> None:
        """The request enters `stage` (`stage_cpu.STAGES`), for the stage profile."""
        if self.clock is not None:
            self.clock.mark(stage)

    def envoy_message(self, kind: str | None) -> None:
        """Envoy's next message for the request arrived: its stage, for the stage profile."""
        if self.clock is None:
            return
        self.clock.messages += 1
        if kind == "response_body":
            first = self.clock.stage != "first chunk" and "first chunk" not in self.clock.spent
            self.clock.mark("first chunk" if first else "later chunks")
        else:
            self.clock.mark(MESSAGE_STAGES.get(kind or "", "end"))

    def replied(self) -> None:
        """A reply went to Envoy (counted for the stage profile)."""
        if self.clock is not None:
            self.clock.replies += 1

    def _ns(self, at: float) -> int:
        return self._start_ns + int((at - self._start) * 1e9)

    def headers(self, handler: str | None, headers: Mapping[str, str]) -> None:
        self.api = handler or "unrouted"
        if self._o.tracer is not None:
            self._span = tracing.request_span(self._o.tracer, f"tito {self.api}", headers, self._start_ns)
            self._span.set_attribute("tito.request_id", self.request_id)

    def _child(self, name: str, started: float, ended: float, **attributes: str | int | float) -> None:
        if self._span is not None and self._o.tracer is not None:
            span = tracing.child_span(self._o.tracer, self._span, name, self._ns(started))
            span.set_attributes(attributes)
            span.end(self._ns(ended))

    def rendered(self, started: float, source: str, cause: str | None = None) -> None:
        """Tokenization ended: `source` is render, local_tokenizer (the fallback: `cause` says
        why render was not used) or refused (no fallback allowed)."""
        ended = time.perf_counter()
        self._o.metrics.render_seconds.labels(source).observe(ended - started)
        if source == "local_tokenizer":
            self._o.metrics.render_fallbacks.labels(cause or "").inc()
        latency = _ms(ended - started)
        if cause is None:
            level = logging.WARNING if self.render_retried else logging.DEBUG
            retried = {"retried": self.render_retried} if self.render_retried else {}
            stage("render.ok", self.request_id, level, endpoint=self.render_endpoint, **retried, latency_ms=latency)
        else:
            stage(f"render.{source}", self.request_id, logging.WARNING, cause=cause, latency_ms=latency)
        attributes = {"tito.source": source, "tito.fallback_cause": cause or "", "tito.endpoint": self.render_endpoint}
        self._child("render", started, ended, **attributes)

    def scheduled(self, started: float, prompt_tokens: int) -> None:
        ended = time.perf_counter()
        self.prompt_tokens = prompt_tokens
        self._o.metrics.schedule_seconds.observe(ended - started)
        self._child("schedule", started, ended, **{"tito.prompt_tokens": prompt_tokens})

    def coalesced(self, stream_interval: int) -> None:
        """The request's engine streams carry up to `stream_interval` tokens per event."""
        self.stream_interval = stream_interval
        self._o.metrics.stream_interval.observe(stream_interval)

    def resolved(self, model: str) -> None:
        """The request's model is known (the catalog's resolution)."""
        self.model = model
        if self._span is not None:
            self._span.set_attribute("tito.model", model)

    def rejected(self, code: str) -> None:
        self._o.metrics.admission_rejections.labels(code).inc()

    def committed(self, lease_id: str, matched_tokens: int) -> None:
        """A leg was placed on an instance holding `matched_tokens` of its prompt (per the index)."""
        self._matched[lease_id] = matched_tokens
        self._o.metrics.prefix_matched_tokens.inc(matched_tokens)

    def leg(self, lease_id: str, hosts: tuple[str, ...], role: str = "routed") -> dict[str, str]:
        """An engine leg starts: logged; its span's context as the engine's `traceparent`
        (tracing off: none, the client's own goes on)."""
        instance, matched = hosts[0] if hosts else "", self._matched.get(lease_id, 0)
        stage(
            "generate",
            self.request_id,
            lease=lease_id,
            model=self.model,
            role=role,
            instance=instance,
            matched_tokens=matched,
            stream_interval=self.stream_interval,
        )
        if self._span is None or self._o.tracer is None:
            return {}
        span = tracing.child_span(self._o.tracer, self._span, "generate", time.time_ns(), SpanKind.CLIENT)
        span.set_attributes({"tito.lease": lease_id, "tito.role": role, "tito.instance": hosts[0] if hosts else ""})
        self._legs[lease_id] = span
        return tracing.traceparent(span)

    def leg_done(self, lease_id: str, served_by: str | None, failed: tuple[str, ...] = ()) -> None:
        for instance in failed:
            self._o.metrics.engine_retries.labels(instance).inc()
        if failed:
            stage(
                "retry", self.request_id, logging.WARNING, lease=lease_id, failed=",".join(failed), served_by=served_by
            )
        span = self._legs.pop(lease_id, None)
        if span is not None:
            span.set_attribute("tito.served_by", served_by or "")
            span.end()

    def relayed(self, lease_id: str, failed: str, to: str, committed_tokens: int, cause: str) -> None:
        """An engine failed mid-answer; the stream goes on as `lease_id` on `to`."""
        self._o.metrics.relays.inc()
        fields = {"lease": lease_id, "failed": failed, "to": to, "committed_tokens": committed_tokens, "cause": cause}
        stage("relay", self.request_id, logging.WARNING, **fields)

    def native_replay(self, instance: str) -> None:
        self._o.metrics.native_replays.inc()
        stage("native_replay", self.request_id, logging.WARNING, instance=instance)

    def answered(self, status: int, code: str | int | None = None, end: bool = False) -> None:
        """The client's status (and error code); `end`: the whole answer went with it."""
        self.status = status
        if code is not None:
            self.code = str(code)
        self.complete = self.complete or end

    def handed_off(self) -> None:
        """Envoy forwards the rest untouched (passthrough): the engine's status is Envoy's to
        count (its route stats); ours is 0."""
        self.complete = True

    def chunk(self, end: bool) -> None:
        """Response body bytes went to the client (the first: its time to first token)."""
        if self._first_chunk is None:
            self._first_chunk = time.perf_counter()
        self.complete = self.complete or end

    def derendered(self, started: float) -> None:
        """A sampled client chunk was derendered since `started` (a count in a fixed array;
        the histogram and the span get them when the request ends)."""
        chunks, ended = self._chunks, _clock()
        spent = ended - started
        chunks.counts[int(spent * 1e6).bit_length()] += 1
        chunks.seconds += spent
        chunks.end = ended
        if not chunks.first:
            chunks.first = started

    def answer_failed(self, code: str | int | None) -> None:
        """An error ended the answer: a stream's error event, or a failed whole derender."""
        self.code = str(code or "stream_error")
        name = "derender.failure" if self.code.startswith("derender") else "stream.failure"
        stage(name, self.request_id, logging.WARNING, code=self.code)

    def finish(self, cancelled: bool = False) -> None:
        """The request is over: its metrics, its stage line if the client left, its spans."""
        if self._finished:
            return
        self._finished = True
        if self.clock is not None and self._o.stages is not None:
            self._o.stages.finished(self.clock)
        ended = time.perf_counter()
        metrics, api = self._o.metrics, self.api
        if cancelled:
            metrics.cancellations.labels(api).inc()
            stage("cancelled", self.request_id, status=self.status, completion_tokens=self.completion_tokens)
        status = str(self.status) if self.status is not None else "499" if cancelled else "0"
        metrics.requests.labels(api, status, self.code, self.model).inc()
        metrics.request_seconds.labels(api).observe(ended - self._start)
        metrics.derender_chunk.merge(self._chunks)
        if self._first_chunk is not None and (self.status or 0) < 400 and not self.code:
            metrics.ttft_seconds.labels(api).observe(self._first_chunk - self._start)
        if self.prompt_tokens:
            metrics.prompt_tokens.labels(api).observe(self.prompt_tokens)
            metrics.completion_tokens.labels(api).observe(self.completion_tokens)
        self._end_spans(ended, status, cancelled)

    def _end_spans(self, ended: float, status: str, cancelled: bool) -> None:
        if self._span is None:
            return
        chunks = self._chunks
        if chunks.first:
            spent = {"tito.timed_chunks": chunks.n, "tito.timed_derender_ms": _ms(chunks.seconds)}
            self._child("derender", chunks.first, chunks.end, **spent)
        for lease in list(self._legs):
            self.leg_done(lease, None)
        self._span.set_attributes(
            {"http.response.status_code": int(status), "tito.error_code": self.code, "tito.cancelled": cancelled}
        )
        if self.status is not None and self.status >= 500 or self.code:
            self._span.set_status(Status(StatusCode.ERROR, self.code))
        self._span.end(self._ns(ended))


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)
