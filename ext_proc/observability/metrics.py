"""The processor's Prometheus metrics (`tito_*`), one registry per processor process.

Several processor processes each serve their own admin port (`processor.admin_port`), so each
exposes its own numbers and Prometheus sums them: nothing is shared between processes, and no
multiprocess directory is needed. Labels are bounded (API, status, error code, cause, engine
instance); never a request id.

Per-request series use prometheus_client. The one per-chunk series (derender time) is counted
per request in a fixed array (`ChunkCounts`) and merged when the request ends: one `observe`
of prometheus_client costs about 0.8 µs (a lock and a bucket walk), 5% of an in-process
derender step.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
FAST_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1)
TOKEN_BUCKETS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class ChunkHistogram(Collector):
    """Derender time per chunk, for the hot path: power-of-two buckets in µs (1 µs … 131 ms),
    so a chunk's bucket is one `bit_length` and a request keeps a fixed array of counts
    (`ChunkCounts`), merged here when it ends. Single-threaded (the processor's loop)."""

    BOUNDS_S = tuple(2**k / 1e6 for k in range(18))

    def __init__(self, name: str, documentation: str) -> None:
        self._name, self._doc = name, documentation
        self._counts = [0] * (len(self.BOUNDS_S) + 1)
        self._sum = 0.0

    def merge(self, chunks: ChunkCounts) -> None:
        last = len(self.BOUNDS_S)  # longer than the last bound: +Inf
        for index in range(last):
            self._counts[index] += chunks.counts[index]
        self._counts[last] += sum(chunks.counts[last:])
        self._sum += chunks.seconds

    def collect(self) -> Iterator[Metric]:
        cumulative, running = [], 0
        for bound, count in zip((*map(repr, self.BOUNDS_S), "+Inf"), self._counts, strict=True):
            running += count
            cumulative.append((bound, running))
        yield HistogramMetricFamily(self._name, self._doc, buckets=cumulative, sum_value=self._sum)


class ChunkCounts:
    """One request's derender chunks: counts per `ChunkHistogram` bucket (index = the
    bit_length of the time in whole µs; 64 covers any duration), their sum, first and last."""

    __slots__ = ("counts", "seconds", "first", "end")

    def __init__(self) -> None:
        self.counts = [0] * 64
        self.seconds = 0.0
        self.first = 0.0  # the first chunk's start
        self.end = 0.0  # the last chunk's end

    @property
    def n(self) -> int:
        return sum(self.counts)


class StateGauges(Collector):
    """What `/debug/state` shows, as gauges read at scrape time."""

    def __init__(self, state: Callable[[], dict[str, Any]]) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        state = self._state()
        scheduler = state["scheduler"]
        yield _gauge("tito_active_exchanges", "Envoy streams the processor is serving", state["active_exchanges"])
        yield _gauge("tito_open_http_streams", "HTTP streams open to render and engines", state["open_http_streams"])
        yield _gauge("tito_inflight_bytes", "request and response bytes held in flight", state["inflight_bytes"])
        yield _gauge("tito_trigger_waiting", "Trigger decode legs waiting for their callback", state["trigger_waiting"])
        yield _gauge("tito_admitted_tokens", "tokens admitted and not yet released", scheduler["total_active_tokens"])
        yield _gauge(
            "tito_event_loop_lag_p99_ms", "event-loop lag, p99 of the last minute", state["event_loop_lag"]["p99_ms"]
        )
        yield _gauge("tito_event_loop_lag_max_ms", "event-loop lag, max since start", state["event_loop_lag"]["max_ms"])
        yield _gauge("tito_draining", "1 while the processor drains (SIGTERM)", int(state["draining"]))
        tokens = GaugeMetricFamily("tito_instance_active_tokens", "admitted tokens per engine", labels=["instance"])
        requests = GaugeMetricFamily("tito_instance_active_requests", "active legs per engine", labels=["instance"])
        breaker = GaugeMetricFamily(
            "tito_instance_breaker_open", "1 while the breaker is not closed", labels=["instance"]
        )
        for address, instance in scheduler["instances"].items():
            tokens.add_metric([address], instance["active_tokens"])
            requests.add_metric([address], instance["active_requests"])
            breaker.add_metric([address], int(instance["breaker"] != "closed"))
        yield from (tokens, requests, breaker)
        yield from _render_gauges(state["render_endpoints"])
        yield from _pool_gauges(state["pools"])
        yield from _flow_gauges(state["flow"])
        if "capabilities" in state:
            yield from _capability_gauges(state["capabilities"])


def _flow_gauges(flow: dict[str, Any]) -> Iterator[Metric]:
    """The admission queue: what waits per band, the queued tokens (the autoscaling signal:
    deploy/keda), and how long the oldest has waited."""
    queued = GaugeMetricFamily("tito_flow_queue_requests", "requests waiting for admission", labels=["band"])
    for band, flows in flow["bands"].items():
        queued.add_metric([band], sum(f["requests"] for f in flows.values()))
    yield queued
    yield _gauge("tito_flow_queued_tokens", "tokens the waiting requests would be admitted with", flow["tokens"])
    yield _gauge(
        "tito_flow_oldest_wait_seconds", "how long the oldest waiting request has waited", flow["oldest_wait_s"]
    )


def _render_gauges(endpoints: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """The render pool's endpoints (every base model's): load, breaker and latency."""
    families = {
        "in_flight": GaugeMetricFamily("tito_render_in_flight", "renders in flight per endpoint", labels=["endpoint"]),
        "outstanding_bytes": GaugeMetricFamily(
            "tito_render_outstanding_bytes",
            "request bytes queued on or rendering at each endpoint",
            labels=["endpoint"],
        ),
        "breaker": GaugeMetricFamily(
            "tito_render_breaker_open", "1 while the render endpoint's breaker is not closed", labels=["endpoint"]
        ),
        "p99_ms": GaugeMetricFamily(
            "tito_render_p99_ms", "p99 of the endpoint's last 256 renders, milliseconds", labels=["endpoint"]
        ),
    }
    cache: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
        "lookups": CounterMetricFamily(
            "tito_render_prefix_cache_lookups", "chat text pieces looked up in the prefix cache", labels=["endpoint"]
        ),
        "hits": CounterMetricFamily(
            "tito_render_prefix_cache_hits", "chat text pieces whose ids the prefix cache held", labels=["endpoint"]
        ),
        "char_hit_rate": GaugeMetricFamily(
            "tito_render_prefix_cache_char_hit_rate", "share of chat text the prefix cache served", labels=["endpoint"]
        ),
    }
    for name, endpoint in endpoints.items():
        for key, family in cache.items():
            if "prefix_cache" in endpoint:
                family.add_metric([name], endpoint["prefix_cache"][key])
        families["in_flight"].add_metric([name], endpoint["in_flight"])
        families["outstanding_bytes"].add_metric([name], endpoint["outstanding_bytes"])
        families["breaker"].add_metric([name], int(endpoint["breaker"] != "closed"))
        if endpoint["p99_ms"] is not None:
            families["p99_ms"].add_metric([name], endpoint["p99_ms"])
    yield from families.values()
    yield from cache.values()


def _pool_gauges(pools: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """Each pool's instances by state (routes, held_out, damped), and its joins and leaves."""
    instances = GaugeMetricFamily(
        "tito_pool_instances", "engine instances per pool and state", labels=["pool", "source", "state"]
    )
    joins = CounterMetricFamily("tito_pool_joins", "instances that joined the pool", labels=["pool"])
    leaves = CounterMetricFamily("tito_pool_leaves", "instances that left the pool", labels=["pool"])
    for name, pool in pools.items():
        states = Tally(why.split(":", 1)[0].replace(" ", "_") for why in pool["instances"].values())
        for state in ("routes", "held_out", "damped"):
            instances.add_metric([name, pool["source"], state], states.get(state, 0))
        joins.add_metric([name], pool["joins"])
        leaves.add_metric([name], pool["leaves"])
    yield from (instances, joins, leaves)


CAPABILITY_LABELS = ("instance", "version", "token_only", "tokenizer", "block_size", "max_model_len", "path")


def _capability_gauges(capabilities: dict[str, Any]) -> Iterator[Metric]:
    """One info series per engine (its record's values as labels, 1) and whether it routes."""
    info = GaugeMetricFamily(
        "tito_instance_capability_info", "what an engine's capability record says", labels=list(CAPABILITY_LABELS)
    )
    routes = GaugeMetricFamily(
        "tito_instance_routes", "1 while the engine's capability record lets it route", labels=["instance"]
    )
    for address, record in capabilities["engines"].items():
        values = {"instance": address, **{k: str(record.get(k, "")) for k in CAPABILITY_LABELS[1:]}}
        info.add_metric([values[k] for k in CAPABILITY_LABELS], 1)
        routes.add_metric([address], int(record.get("routes", False)))
    render = GaugeMetricFamily(
        "tito_render_endpoint_used",
        "1 while the render endpoint's tokenizer agrees with the engines'",
        labels=["endpoint"],
    )
    for name, record in capabilities["render"].items():
        render.add_metric([name], int(record["used"]))
    yield from (info, routes, render)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


class Metrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)

        def histogram(name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        self.render_seconds = histogram(
            "tito_render_seconds", "tokenization: render, local_tokenizer or refused", ("source",), LATENCY_BUCKETS
        )
        self.render_endpoint_seconds = histogram(
            "tito_render_endpoint_seconds",
            "one render on one render endpoint, by outcome (ok, rejected, timeout, unavailable, ...)",
            ("endpoint", "outcome"),
            LATENCY_BUCKETS,
        )
        self.schedule_seconds = histogram("tito_schedule_seconds", "scheduling decision", (), FAST_BUCKETS)
        self.ttft_seconds = histogram(
            "tito_time_to_first_token_seconds", "request start to the first streamed chunk", ("api",), LATENCY_BUCKETS
        )
        self.request_seconds = histogram(
            "tito_request_duration_seconds", "request start to its end", ("api",), LATENCY_BUCKETS
        )
        self.prompt_tokens = histogram("tito_prompt_tokens", "prompt tokens per request", ("api",), TOKEN_BUCKETS)
        self.completion_tokens = histogram(
            "tito_completion_tokens", "completion tokens per request", ("api",), TOKEN_BUCKETS
        )
        self.stream_interval = histogram(
            "tito_stream_interval", "tokens per engine event asked of a request's engines", (), (1, 2, 4, 8, 16, 32, 64)
        )
        self.derender_chunk = ChunkHistogram("tito_derender_chunk_seconds", "derender time per client chunk")
        registry.register(self.derender_chunk)
        self.requests = counter(
            "tito_requests", "requests by API, client status, error code and model", ("api", "status", "code", "model")
        )
        self.render_fallbacks = counter("tito_render_fallbacks", "requests tokenized locally, by cause", ("cause",))
        self.native_replays = counter("tito_native_replays", "requests replayed on an engine's native endpoint")
        self.engine_retries = counter(
            "tito_engine_retries", "Envoy retries on another engine, by failed engine", ("instance",)
        )
        self.breaker_transitions = counter(
            "tito_breaker_transitions", "engine breaker state changes", ("instance", "state")
        )
        self.breaker_panics = counter(
            "tito_breaker_panics", "legs routed with every breaker of their pool open (panic routing)", ("role",)
        )
        self.admission_rejections = counter("tito_admission_rejections", "requests refused by admission", ("code",))
        self.relays = counter("tito_relays", "engine streams replaced mid-answer (reschedule)")
        self.prefix_matched_tokens = counter(
            "tito_prefix_matched_tokens", "prompt tokens the chosen instance held in its KV cache, per the index"
        )
        self.cancellations = counter("tito_cancellations", "requests whose client left before the end", ("api",))
        self.flow_requests = counter(
            "tito_flow_requests",
            "flow control outcomes (dispatched, rejected_*, evicted) by priority band",
            ("band", "outcome"),
        )
        self.flow_queue_seconds = histogram(
            "tito_flow_queue_seconds",
            "time queued before admission, by band and outcome",
            ("band", "outcome"),
            LATENCY_BUCKETS,
        )
        self.tenant_tokens = counter(
            "tito_tenant_admitted_tokens", "tokens admitted per API-key tenant (prompt + n x max_tokens)", ("tenant",)
        )
        self.conversation_store = counter(
            "tito_conversation_store_operations",
            "the conversation store (kept turns): put, get, delete by outcome (ok, not_found, error)",
            ("op", "outcome"),
        )

    def flow_outcome(self, band: str, outcome: str, waited_s: float) -> None:
        self.flow_requests.labels(band, outcome).inc()
        if outcome == "evicted":  # (in flight, not queued)
            return
        if outcome != "dispatched" or waited_s > 0:  # (at once: not queued)
            self.flow_queue_seconds.labels(band, outcome).observe(waited_s)

    def watch(self, state: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(StateGauges(state))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
