"""One typed config for the whole gateway, from one YAML file plus environment overrides.

Overrides: `TITO__<SECTION>__<KEY>=value` (double underscores nest, case-insensitive keys,
values parsed as YAML so `TITO__RENDER_CONFIG__ENDPOINT__PORT=8101` is an int and
`TITO__POOLS='[{name: union, instances: [{host: 127.0.0.1, port: 8201}]}]'` a list).
The config file is `--config`, else `$TITO_CONFIG`, else defaults that work locally.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

ENV_PREFIX = "TITO__"
MiB = 1 << 20


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Endpoint(_Strict):
    host: str = "127.0.0.1"
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class PublicRoute(_Strict):
    """One method + path the listener serves; every other request gets a 404 from Envoy
    and reaches nothing. `handler` says who answers: chat/completions are rendered and
    routed token-only, as are Anthropic Messages (`messages`: chat inside the gateway, as in
    native vLLM; `messages_count_tokens`: render alone) and OpenAI Responses (`responses`: the
    stateless subset, completions inside the gateway), passthrough goes to an engine
    untouched (never breaker input), health and models (the model catalog's /v1/models) are
    answered by the processor."""

    method: Literal["GET", "POST"]
    path: str
    handler: Literal[
        "chat", "completions", "messages", "messages_count_tokens", "responses", "passthrough", "health", "models"
    ]


DEFAULT_ROUTES = [
    PublicRoute(method="POST", path="/v1/chat/completions", handler="chat"),
    PublicRoute(method="POST", path="/v1/completions", handler="completions"),
    PublicRoute(method="POST", path="/v1/messages", handler="messages"),
    PublicRoute(method="POST", path="/v1/messages/count_tokens", handler="messages_count_tokens"),
    PublicRoute(method="POST", path="/v1/responses", handler="responses"),
    PublicRoute(method="GET", path="/v1/models", handler="models"),
    PublicRoute(method="GET", path="/health", handler="health"),
]


class ListenerConfig(_Strict):
    """Envoy's OpenAI-facing listener, its edge limits and its admin port."""

    host: str = "127.0.0.1"
    port: int = 8080
    admin_port: int = 9901
    # Envoy's admin (stats, /ready; also /quitquitquit): loopback unless a scraper needs it
    admin_host: str = "127.0.0.1"
    routes: list[PublicRoute] = Field(default_factory=lambda: list(DEFAULT_ROUTES))
    max_request_bytes: int = 32 * MiB  # request bodies; the processor answers 413 as bytes cross it
    stream_idle_timeout_s: int = 300
    request_headers_timeout_s: int = 10  # a client that never finishes its headers
    request_timeout_s: int = 60  # a client that never finishes its body (trickling uploads)
    max_concurrent_streams: int = 128  # per HTTP/2 client connection
    max_connections: int = 10000  # downstream connections, all listeners
    envoy_max_heap_bytes: int = 1 << 30  # overload manager: shed load before Envoy's heap reaches it

    @model_validator(mode="after")
    def _unique_routes(self) -> ListenerConfig:
        keys = [(r.method, r.path) for r in self.routes]
        if len(set(keys)) != len(keys) or any(not r.path.startswith("/") for r in self.routes):
            raise ValueError("listener.routes: each method+path once, paths starting with '/'")
        return self

    def handler(self, method: str, path: str) -> str | None:
        """Who answers this request (query string ignored, as in Envoy's exact path match)."""
        path = path.split("?", 1)[0]
        for route in self.routes:
            if route.method == method and route.path == path:
                return route.handler
        return None


class ProcessorConfig(_Strict):
    """The gRPC ext_proc server Envoy talks to."""

    host: str = "127.0.0.1"  # where Envoy reaches the processor
    listen_host: str = "127.0.0.1"  # what the processor binds (0.0.0.0 in containers)
    port: int = 9002
    admin_port: int = 9003  # /health, /debug/state, /metrics (on listen_host)
    grpc_max_message_bytes: int = 64 * MiB
    http_max_connections: int = 256
    max_streams: int = 2048  # concurrent ext_proc streams Envoy may open (its circuit breaker)
    max_response_bytes: int = 64 * MiB  # a buffered (non-streaming) engine response; over it: 502
    # Request bodies + buffered responses of all streams; over it: 503. None: one maximal
    # body (listener.max_request_bytes), so the processor's RSS stays within twice that under
    # any burst of uploads (the rest is transport buffers). Raise it for many large bodies.
    max_inflight_bytes: int | None = None
    fallback_tokenizer_timeout_s: float = 10.0  # the local tokenizer's chat template, per request
    # Processor-owned streams (fan-out, relay): SSE pieces waiting for the client, per request;
    # when full, the engine streams wait (backpressure), nothing is dropped.
    owned_queue_depth: int = 32
    # SIGTERM: open streams may finish this long; then they end with an error event
    drain_timeout_s: float = 30.0
    # Processor processes on this host (`tito processor --workers N`), each a gRPC server
    # Envoy balances streams over: one Python process tops out at a few thousand chunks/s.
    # Worker i takes the port pair `port + 2i`, `admin_port + 2i` (9002/9003, 9004/9005, ...).
    workers: int = Field(default=1, ge=1)
    worker_index: int = Field(default=0, ge=0)  # set by the supervisor for each worker
    # uvloop (what vLLM's API server runs on): the gRPC handling of each ext_proc message costs
    # about a quarter less CPU than on asyncio's own loop (`tests/bench/grpc_bench.py`).
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"

    @model_validator(mode="after")
    def _worker_ports_disjoint(self) -> ProcessorConfig:
        grpc, admin = (set(ports) for ports in zip(*self.worker_ports(), strict=True))
        if grpc & admin:
            raise ValueError(
                f"processor: {self.workers} workers take ports port + 2i and admin_port + 2i;"
                f" {sorted(grpc & admin)} would be both (make admin_port - port odd)"
            )
        return self

    def worker_ports(self) -> list[tuple[int, int]]:
        """(gRPC port, admin port) of every worker, worker 0 first."""
        base = 2 * self.worker_index
        return [(self.port - base + 2 * i, self.admin_port - base + 2 * i) for i in range(self.workers)]

    def for_worker(self, index: int) -> ProcessorConfig:
        """Worker `index`'s own ports (its admin port also serves its Trigger callbacks)."""
        shift = 2 * (index - self.worker_index)
        return self.model_copy(
            update={"port": self.port + shift, "admin_port": self.admin_port + shift, "worker_index": index}
        )


class RenderEndpoint(Endpoint):
    """One render process of the pool."""

    timeout_ms: int | None = None  # this endpoint's own per-attempt timeout (None: the pool's)


class RenderConfig(_Strict):
    """sidecar: the render sidecar over HTTP (the RFC's Render service). in_process: vLLM's
    own renderer (what the sidecar serves) loaded into the processor at start-up, no HTTP hop:
    ~2 ms per chat render instead of 7-11 ms through the sidecar; the same answers and
    outcomes (fallback, rejection)."""

    enable: bool = True
    mode: Literal["sidecar", "in_process"] = "sidecar"
    endpoint: Endpoint = Endpoint(port=8100)
    # The render pool (RFC Render Pool): one endpoint per render process or host. Empty:
    # `replicas` endpoints on `endpoint`'s host, from its port up (`tito up` starts them).
    endpoints: list[RenderEndpoint] = Field(default_factory=list)
    replicas: int = Field(default=1, ge=1)
    timeout_ms: int = 5000  # per endpoint attempt (an endpoint's own `timeout_ms` overrides it)
    breaker_cooldown_s: float = 5.0  # after a render failure, that endpoint is skipped this long
    # a slow endpoint: a warning when the p99 of its last renders exceeds this
    p99_budget_ms: float = 1000.0
    # in_process: chat text tokenized per piece between special tokens, each piece once
    # (`ext_proc/frontend/render_prefix_cache.py`; byte-identical, fuzzed in `make test`)
    prefix_cache: bool = True
    prefix_cache_max_ids: int = 2_000_000  # token ids it holds (about 60 bytes each)
    # in_process: each distinct reasoning/tool parser built once, not twice per chat render
    # (`ext_proc/frontend/render_parser_cache.py`; checked against fresh parsers in `make test`)
    reuse_parsers: bool = True
    renderer_num_workers: int = 4
    image_name: str = "vllm/vllm-openai:v0.32.0"

    def pool(self) -> list[RenderEndpoint]:
        """Every render endpoint of this base model (sidecar mode), the first one first."""
        if self.endpoints:
            return list(self.endpoints)
        first = self.endpoint
        return [RenderEndpoint(host=first.host, port=first.port + i) for i in range(self.replicas)]

    @model_validator(mode="after")
    def _first_endpoint(self) -> RenderConfig:
        """`endpoint` is always the first of the pool (what derender's sidecar mode and a
        one-endpoint deployment use)."""
        if self.endpoints:
            self.endpoint = Endpoint(host=self.endpoints[0].host, port=self.endpoints[0].port)
        return self


class DerenderConfig(_Strict):
    """Where generate output becomes OpenAI responses.

    in_process: live per-choice state in the processor (vLLM's incremental detokenizer and
    the model's reasoning/tool parser, fed only new ids): what coupled vLLM serving costs.
    sidecar: one call to the render sidecar's /derender per event (the RFC baseline, which
    replays the whole output on every call when a parser is configured); kept as the oracle
    of the parity tests and for deployments that keep tokenizers out of the gateway.
    """

    mode: Literal["in_process", "sidecar"] = "in_process"
    # Engine-side coalescing: vLLM's per-request `stream_interval` (an engine event carries up
    # to k new tokens; the first and the last go at once). 1: one event per token, as native;
    # N: always N; auto: 1 while the processor keeps up, raised with its event-loop lag.
    stream_interval: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = "auto"


class AdapterConfig(_Strict):
    """A LoRA adapter of the base model: clients name it as `model`; `path` is where the
    engines read it (`tito up` passes it as --lora-modules; `lora.on_missing: load` loads it)."""

    name: str
    path: str | None = None  # None: `tito up` generates a tiny adapter of its tiny model


class ModelConfig(_Strict):
    """Read once and shared by the render sidecar and every engine, so both tokenize alike.
    The model catalog: this base model under `served_name` and its `aliases`, and its LoRA
    adapters (these, and what each engine's /v1/models lists with this base as `parent`)."""

    path: str | None = None  # None: `tito up` generates a tiny model into local.cache_dir
    served_name: str = "tiny"
    aliases: list[str] = Field(default_factory=list)  # more names for the base (the engines' too)
    adapters: list[AdapterConfig] = Field(default_factory=list)
    max_model_len: int = 2048
    chat_template: str | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False

    @property
    def has_parser(self) -> bool:
        return bool(self.reasoning_parser or self.tool_call_parser)


class LoraConfig(_Strict):
    """LoRA adapters across a pool's instances (RFC 多模型路由): prefer an instance that runs
    the adapter, keep each within its engine's `max_loras`, spread a hot adapter."""

    # An adapter no instance lists: `route` sends it anyway (the engine may resolve it
    # itself, else answers 404), `load` has the chosen instance load it first (its path from
    # `model.adapters`; engines need VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), `reject` answers 404.
    on_missing: Literal["route", "load", "reject"] = "route"
    max_loras: int = Field(default=1, ge=1)  # adapters an engine runs at once (its --max-loras)
    max_lora_rank: int = Field(default=16, ge=1)  # `tito up`'s engines (--max-lora-rank)
    # An adapter's requests in flight on an instance beyond which the next goes to another
    # instance with room (a hot adapter spreads instead of queueing on one engine).
    spread_requests: int = Field(default=8, ge=1)


class KvEventsEndpoint(_Strict):
    """An engine's KV cache event publisher (vLLM --kv-events-config: endpoint, replay_endpoint, topic)."""

    endpoint: str  # e.g. tcp://10.0.0.7:5557 (the engine binds tcp://*:5557)
    replay_endpoint: str
    topic: str = ""


class InstanceConfig(Endpoint):
    """One engine. `capabilities` (decode instances): `prefill_handoff_decode` (Handoff: the
    gateway prefills first), `concurrent_engine_sync` (Trigger: the engine calls back for
    prefill), `decode_colocation` (may also serve a request alone)."""

    capabilities: list[Literal["prefill_handoff_decode", "concurrent_engine_sync", "decode_colocation"]] = Field(
        default_factory=list
    )
    kv_events: KvEventsEndpoint | None = None  # with scheduler.prefix_source: kv_events


class PoolConfig(_Strict):
    name: str = "union"
    role: Literal["union", "prefill", "decode"] = "union"
    instances: list[InstanceConfig] = Field(default_factory=lambda: [InstanceConfig(port=8200)])
    max_requests_per_instance: int = 1024  # Envoy's circuit breaker for these engines
    # The engines' KV block size, which the prefix index hashes in: vLLM's default is 128 on
    # CPUs (what `tito up` runs, and passes on as --block-size) and Ascend NPUs, 16 on GPUs.
    block_size: int = 128
    # How KV moves from prefill to decode: `example` (a shared folder: prefill returns no
    # params, decode finds the KV by prompt), `nixl` (prefill returns pull params decode needs).
    kv_connector: Literal["none", "example", "nixl"] = "none"

    @model_validator(mode="after")
    def _one_decode_mode(self) -> PoolConfig:
        # a decode instance that declares no mode does Handoff
        default = ["prefill_handoff_decode"] if self.role == "decode" else []
        modes = {c for i in self.instances for c in (i.capabilities or default) if c != "decode_colocation"}
        if len(modes) > 1:
            raise ValueError(f"pool {self.name}: Handoff and Trigger instances cannot be mixed in one decode pool")
        return self


class BreakerSettings(_Strict):
    failure_threshold: int = 3  # consecutive engine failures that open an instance's breaker
    base_cooldown_s: float = 5.0  # first open period; doubles after each failed half-open probe
    max_cooldown_s: float = 60.0


class SchedulerConfig(_Strict):
    policy: Literal["kv_cache_affinity", "load_balance", "round_robin"] = "kv_cache_affinity"
    prefix_index_max_blocks: int = 1 << 20
    # kv_cache_affinity score (Motor's unified mode), lowest wins
    prefill_load_scale: float = 1.0
    overlap_credit: float = 1.0
    load_weight: float = 1.0
    hit_rate_threshold: float = 0.0
    max_fallbacks: int = 2  # other instances Envoy may retry on before the first byte
    retry_budget_percent: float = 20.0  # Envoy retries at most this share of active requests
    # on: clamp max_tokens to max_model_len - prompt tokens; prompts that do not fit get a 400
    context_budget_mode: Literal["on", "off"] = "off"
    # Where the prefix index learns what engines hold: their KV cache events (instances with
    # `kv_events` set; hashes as the engines compute them: --prefix-caching-hash-algo
    # sha256_cbor, pools[].block_size their block size), else what this gateway routed.
    # Instances without `kv_events` (or whose stream is down or lags) use routing records.
    prefix_source: Literal["routing", "kv_events"] = "kv_events"
    kv_events_lag_s: float = 5.0  # no event this long after a commit: that instance falls back to routing
    hash_seed: str = "vllm-none-hash"  # the engines' PYTHONHASHSEED, when they set one
    # What load balancing counts as an instance's load. ledger: the requests this processor
    # sent. engine_metrics: also what each engine's /metrics reports (running and waiting
    # requests, KV cache usage), polled every engine_metrics_interval_s: processors that share
    # an engine pool then see each other's traffic. A sample older than engine_metrics_stale_s
    # (metrics unreachable): the ledger alone. Admission (token budgets) is the ledger's either way.
    load_source: Literal["ledger", "engine_metrics"] = "ledger"
    engine_metrics_interval_s: float = 1.0
    engine_metrics_stale_s: float = 5.0
    breaker: BreakerSettings = BreakerSettings()


class RescheduleConfig(_Strict):
    """Relay (RFC 流式 replay 与重调度): a streaming single-prompt request whose engine fails
    mid-stream goes on on another instance from the ids the client already has. When on,
    those requests take the processor-owned path (the processor runs the engine stream)."""

    enable: bool = False
    max_attempts: int = 3  # engine streams per request, the first included
    first_token_timeout_s: float = 60.0  # no first event this long: the engine is stalled
    inter_token_timeout_s: float = 30.0  # no next event this long: the engine is stalled


class AdmissionConfig(_Strict):
    """Token budgets (prompt tokens + max_tokens of every active request); None is unlimited.

    The budgets are the whole gateway's. Every processor process (`replicas` gateways with
    `processor.workers` each) enforces an equal share, rounded down, on its own ledger: the
    shares never add up to more than the budget, whichever process Envoy picks, with no
    coordination on the request path. A request larger than one share is refused (429).
    """

    global_token_budget: int | None = None
    instance_token_budget: int | None = None
    replicas: int = Field(default=1, ge=1)  # gateway replicas (hosts) sharing these engines


class ObfuscationConfig(_Strict):
    """Token obfuscation (RFC Token 混淆适配): the engines serve vocabulary-permuted weights,
    so they get physical ids only; render, derender and clients keep semantic ids. When on,
    it fails closed: no local-tokenizer fallback, no native path (both would send plaintext).

    The secret is read from `secret_file`, else from the environment variable `secret_env`
    (the config names where it is, never the secret itself, so a config dump cannot leak it)."""

    enable: bool = False
    provider: str = "permutation"  # the built-in keyed permutation, or "module:factory" (a vendor SDK)
    secret_file: str | None = None
    secret_env: str = "TOKEN_OBFUSCATION_SECRET"
    vocab_size: int | None = None  # None: the model's config.json (text_config.vocab_size first)
    fixed_ids: list[int] = Field(default_factory=list)  # the white list: ids the permutation keeps
    fix_added_tokens: bool = True  # also keep the tokenizer's added tokens (chat control, tags)


class CapabilitiesConfig(_Strict):
    """Capability negotiation (RFC 能力协商): before a client request pays for it, the gateway
    learns what every engine and render endpoint serves (`ext_proc/fleet/capabilities.py`):
    version, models, max_model_len, LoRA adapters, KV block size and hash, KV event sources,
    whether token-only generate is live (an engine without it is served natively from its
    first request), and whether its tokenizer agrees with render's (a canary chat rendered
    and tokenized). An engine routes once its record is complete, and stops at once when a
    probe or liveness check fails; `/ready` is 503 while some pool has no engine that routes.

    on_mismatch: what a block size, hash algorithm or max_model_len other than the config's
    does: `adopt` (the engine's value is used: the pool's prefix index hashes in its block
    size, its KV events are ignored for another hash, requests that do not fit its context
    go elsewhere) or `hold_out` (it does not route). A tokenizer mismatch always holds out."""

    enable: bool = True
    on_mismatch: Literal["adopt", "hold_out"] = "adopt"
    interval_s: float = 30.0  # a complete record is refreshed this often
    timeout_s: float = 2.0  # per probe request
    # an endpoint that cannot be probed is tried again after retry_min_s, doubling to retry_max_s
    retry_min_s: float = 0.5
    retry_max_s: float = 5.0
    # liveness: every engine's `GET /health` this often, and at once after a client request
    # failed on it; one that fails it (no connection, a 5xx, no answer within
    # health_timeout_s) stops routing at once and is probed with the backoff above, and its
    # first passing check after that brings on the full probe at once
    health_interval_s: float = Field(default=1.0, gt=0)
    health_timeout_s: float = Field(default=1.0, gt=0)  # per liveness check


class LoggingConfig(_Strict):
    """The processor's log lines: text, or one JSON object per line (stage fields as keys)."""

    format: Literal["text", "json"] = "text"


class TracingConfig(_Strict):
    """Where traces go. The processor follows the standard OTEL_* variables first
    (OTEL_EXPORTER_OTLP_ENDPOINT, ...); `collector` (an OTLP/gRPC endpoint) is their default
    and also turns on Envoy's own tracing to the same collector. None and no OTEL_*: off."""

    collector: Endpoint | None = None


class LocalStackConfig(_Strict):
    """What `tito up` needs beyond the gateway itself."""

    cache_dir: str = "~/.cache/tito"
    engine_kv_cache_gib: int = 1
    # Engines without `kv_events` publish on this port pair and the next ones (engine n:
    # + 2n, + 2n + 1) when scheduler.prefix_source is kv_events (vLLM's default port: 5557).
    kv_events_port: int = 5557
    startup_timeout_s: int = 300
    # Put each engine's EngineCore process on its worker's cores once the engine is up (see
    # ext_proc/tools/cpu_affinity.py: unbound, its busy wait starves the rest of a small machine).
    colocate_engine_core: bool = True
    # Engines ("host:port" of pools[].instances) started without --enable-scale-out, as most
    # existing vLLM deployments run: the gateway serves them on their native endpoints.
    engines_without_scale_out: list[str] = Field(default_factory=list)
    # Token obfuscation on: the engines serve a copy of each base model whose vocabulary is
    # permuted by the gateway's own permutation (ext_proc/tools/obfuscated_model.py), as a
    # real deployment's engines serve permuted weights; render keeps the plain model.
    permute_engine_weights: bool = False
    engine_extra_args: list[str] = Field(default_factory=list)  # more `vllm serve` flags for every engine


class BaseModelConfig(_Strict):
    """Another base model of the catalog (RFC 多模型路由): what the top-level `model`,
    `render_config`, `pools` and `obfuscation` are for the first one. Each base has its own
    tokenizer, render endpoint, engines, scheduler and admission ledger, and its own
    obfuscation secret; a request's `model` picks its base before anything is rendered."""

    model: ModelConfig
    render_config: RenderConfig = RenderConfig()
    pools: list[PoolConfig]
    obfuscation: ObfuscationConfig = ObfuscationConfig()


class TitoConfig(_Strict):
    listener: ListenerConfig = ListenerConfig()
    processor: ProcessorConfig = ProcessorConfig()
    render_config: RenderConfig = RenderConfig()
    derender: DerenderConfig = DerenderConfig()
    model: ModelConfig = ModelConfig()
    pools: list[PoolConfig] = Field(default_factory=lambda: [PoolConfig()])
    scheduler: SchedulerConfig = SchedulerConfig()
    admission: AdmissionConfig = AdmissionConfig()
    reschedule: RescheduleConfig = RescheduleConfig()
    lora: LoraConfig = LoraConfig()
    obfuscation: ObfuscationConfig = ObfuscationConfig()
    capabilities: CapabilitiesConfig = CapabilitiesConfig()
    logging: LoggingConfig = LoggingConfig()
    tracing: TracingConfig = TracingConfig()
    local: LocalStackConfig = LocalStackConfig()
    models: list[BaseModelConfig] = Field(default_factory=list)  # more base models (the first is `model`)

    @model_validator(mode="after")
    def _pools_by_role(self) -> TitoConfig:
        for base in self.bases():
            roles = [p.role for p in base.pools]
            if len(set(roles)) != len(roles) or any(not p.instances for p in base.pools):
                raise ValueError("pools: at most one per role, each with at least one instance")
            if "union" not in roles and not {"prefill", "decode"} <= set(roles):
                raise ValueError("pools: a union pool, or a prefill and a decode pool")
        return self

    @model_validator(mode="after")
    def _bases_apart(self) -> TitoConfig:
        """Each base model its own names and its own engines (a request's model picks one)."""
        names = [
            n
            for b in self.bases()
            for n in (b.model.served_name, *b.model.aliases, *(a.name for a in b.model.adapters))
        ]
        engines = [i.address for b in self.bases() for p in b.pools for i in p.instances]
        if len(set(names)) != len(names) or len(set(engines)) != len(engines):
            raise ValueError("models: every base model, alias and adapter name once, every engine in one pool")
        return self

    @model_validator(mode="after")
    def _plain_engines_exist(self) -> TitoConfig:
        addresses = {i.address for b in self.bases() for p in b.pools for i in p.instances}
        unknown = sorted(set(self.local.engines_without_scale_out) - addresses)
        if unknown:
            raise ValueError(f"local.engines_without_scale_out: {unknown} are not instances of any pool")
        return self

    @model_validator(mode="after")
    def _obfuscation_needs_render(self) -> TitoConfig:
        if any(base.obfuscation.enable and not base.render_config.enable for base in self.bases()):
            raise ValueError("obfuscation.enable needs render_config.enable: the local tokenizer would serve plaintext")
        return self

    def bases(self) -> list[TitoConfig]:
        """One config per base model: this one (its `model`, `render_config`, `pools` and
        `obfuscation`), then one per `models` entry with those sections replaced by the
        entry's. Everything below the catalog works on one base's config."""
        return [self] + [
            self.model_copy(
                update={
                    "model": base.model,
                    "render_config": base.render_config,
                    "pools": base.pools,
                    "obfuscation": base.obfuscation,
                    "models": [],
                }
            )
            for base in self.models
        ]

    def pool(self, role: str) -> PoolConfig | None:
        return next((p for p in self.pools if p.role == role), None)

    @property
    def process_token_budgets(self) -> tuple[int | None, int | None]:
        """This process's share of the global and per-instance budgets (AdmissionConfig)."""
        shares = self.admission.replicas * self.processor.workers

        def share(budget: int | None) -> int | None:
            return None if budget is None else budget // shares

        return share(self.admission.global_token_budget), share(self.admission.instance_token_budget)

    @property
    def inflight_bytes(self) -> int:
        return self.processor.max_inflight_bytes or self.listener.max_request_bytes

    def to_yaml(self) -> str:
        return str(yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False))


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for key in path[:-1]:
        child = node.get(key)
        if not isinstance(child, dict):
            child = node[key] = {}
        node = child
    node[path[-1]] = value


def apply_env_overrides(raw: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    for name, value in sorted(env.items()):
        if name.startswith(ENV_PREFIX) and len(name) > len(ENV_PREFIX):
            path = [part.lower() for part in name[len(ENV_PREFIX) :].split("__")]
            _set_path(raw, path, yaml.safe_load(value) if value != "" else None)
    return raw


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> TitoConfig:
    env = os.environ if env is None else env
    path = path or env.get("TITO_CONFIG")
    raw: dict[str, Any] = {}
    if path:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: the config must be a YAML mapping")
    return TitoConfig.model_validate(apply_env_overrides(raw, env))
