"""One typed config for the whole gateway, from one YAML file plus environment overrides.

Overrides: `TITO__<SECTION>__<KEY>=value` (double underscores nest, case-insensitive keys,
values parsed as YAML so `TITO__RENDER_CONFIG__ENDPOINT__PORT=8101` is an int and
`TITO__POOLS='[{name: union, instances: [{host: 127.0.0.1, port: 8201}]}]'` a list).
The config file is `--config`, else `$TITO_CONFIG`, else defaults that work locally.

This module holds `TitoConfig`, its per-base-model sections (model, render, pools,
obfuscation: what `TitoConfig.bases()` swaps per base) and the small process-wide ones
(logging, tracing, the local stack), and the loading. The edge's sections (listener,
processor) are `config_edge.py`'s, the routing ones (scheduler, admission, reschedule, LoRA,
capabilities) `config_routing.py`'s, a pool's discovery `config_discovery.py`'s;
`config_section.py` is their common base.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, model_validator

from ext_proc.config_discovery import DiscoveryConfig
from ext_proc.config_edge import ListenerConfig, ProcessorConfig
from ext_proc.config_routing import (
    AdmissionConfig,
    CapabilitiesConfig,
    LoraConfig,
    RescheduleConfig,
    SchedulerConfig,
)
from ext_proc.config_section import Section
from ext_proc.config_tenancy import TenancyConfig

ENV_PREFIX = "TITO__"


class Endpoint(Section):
    host: str = "127.0.0.1"
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class RenderEndpoint(Endpoint):
    """One render process of the pool."""

    timeout_ms: int | None = None  # this endpoint's own per-attempt timeout (None: the pool's)


class RenderConfig(Section):
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
    # The render server's uvicorn line per render call. Off: the processor's stage lines name
    # every request already (by its id, which these lines lack), and the line was a
    # measurable part of the sidecar's CPU per request (docs/performance.md).
    access_log: bool = False
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


class DerenderConfig(Section):
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


class AdapterConfig(Section):
    """A LoRA adapter of the base model: clients name it as `model`; `path` is where the
    engines read it (`tito up` passes it as --lora-modules; `lora.on_missing: load` loads it)."""

    name: str
    path: str | None = None  # None: `tito up` generates a tiny adapter of its tiny model


class ModelConfig(Section):
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


class KvEventsEndpoint(Section):
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


class PoolConfig(Section):
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
    # Where the instances come from: `static` (the list above), `dns` or `kubernetes`
    # (discovered at run time, `instances` left out): ext_proc/config_discovery.py.
    discovery: DiscoveryConfig = DiscoveryConfig()

    @model_validator(mode="before")
    @classmethod
    def _discovered_not_listed(cls, data: Any) -> Any:
        """A discovered pool lists no instances (its source says them), so none by default."""
        if isinstance(data, dict) and (data.get("discovery") or {}).get("source", "static") != "static":
            if data.get("instances"):
                raise ValueError(f"pool {data.get('name', 'union')}: a discovered pool lists no instances")
            data = {**data, "instances": []}
        return data

    def discovered(self, host: str, port: int) -> InstanceConfig:
        """A discovered instance at `host`:`port`; its declarations are the discovery's."""
        d = self.discovery
        events = None
        if d.kv_events_port is not None:
            bare = host.strip("[]")
            where = f"[{bare}]" if ":" in bare else bare
            events = KvEventsEndpoint(
                endpoint=f"tcp://{where}:{d.kv_events_port}", replay_endpoint=f"tcp://{where}:{d.kv_events_port + 1}"
            )
        return InstanceConfig(host=host, port=port, capabilities=list(d.capabilities), kv_events=events)

    @model_validator(mode="after")
    def _one_decode_mode(self) -> PoolConfig:
        # a decode instance that declares no mode does Handoff
        default = ["prefill_handoff_decode"] if self.role == "decode" else []
        modes = {c for i in self.instances for c in (i.capabilities or default) if c != "decode_colocation"}
        if len(modes) > 1:
            raise ValueError(f"pool {self.name}: Handoff and Trigger instances cannot be mixed in one decode pool")
        return self


class ObfuscationConfig(Section):
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


class LoggingConfig(Section):
    """The processor's log lines: text, or one JSON object per line (stage fields as keys)."""

    format: Literal["text", "json"] = "text"


class TracingConfig(Section):
    """Where traces go. The processor follows the standard OTEL_* variables first
    (OTEL_EXPORTER_OTLP_ENDPOINT, ...); `collector` (an OTLP/gRPC endpoint) is their default
    and also turns on Envoy's own tracing to the same collector. None and no OTEL_*: off."""

    collector: Endpoint | None = None


class LocalStackConfig(Section):
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
    # While an engine starts (scaled up, restarted), the engines already serving yield it their
    # CPU share (their tasks at nice 10, see ext_proc/tools/cpu_affinity.py): beside a busy
    # engine on the same cores a CPU engine otherwise took 2.5 times as long to start.
    yield_to_starting_engines: bool = True
    # Engines ("host:port" of pools[].instances) started without --enable-scale-out, as most
    # existing vLLM deployments run: the gateway serves them on their native endpoints.
    engines_without_scale_out: list[str] = Field(default_factory=list)
    # Token obfuscation on: the engines serve a copy of each base model whose vocabulary is
    # permuted by the gateway's own permutation (ext_proc/tools/obfuscated_model.py), as a
    # real deployment's engines serve permuted weights; render keeps the plain model.
    permute_engine_weights: bool = False
    engine_extra_args: list[str] = Field(default_factory=list)  # more `vllm serve` flags for every engine
    # Engines of each DNS-discovered pool whose name server is on loopback: `tito up` runs
    # that pool itself (dnsmasq + engines on 127.0.0.11, .12, ...); `tito scale N` changes it.
    replicas: int = Field(default=1, ge=0)


class ConversationStoreConfig(Section):
    """What the gateway keeps of answered turns (stored OpenAI Responses: `store`, the API's
    default, then `previous_response_id`, retrieve, delete), where, and for how long."""

    # `sqlite`: one host, every processor worker shares one file. `redis`: processor replicas
    # on several hosts share it. `none`: nothing is kept, as native vLLM without its store
    # (`store` silently off, every `previous_response_id` unknown).
    backend: Literal["none", "sqlite", "redis"] = "sqlite"
    # The SQLite file; every worker on the host opens the same one (a local disk: SQLite's
    # WAL mode needs shared memory, which network filesystems do not give).
    path: str = "/tmp/tito/conversations.sqlite3"
    # The Redis of the `redis` backend (redis://[:password@]host:port/db).
    redis_url: str = "redis://127.0.0.1:6379/0"
    # A stored response is gone this long after it was made (OpenAI keeps them 30 days).
    ttl_s: float = Field(default=30 * 24 * 3600, gt=0)
    # SQLite: over this many, the oldest go first, so the file stays bounded. Redis evicts by
    # its own `maxmemory` policy instead.
    max_entries: int = Field(default=100_000, ge=1)


class BaseModelConfig(Section):
    """Another base model of the catalog (RFC 多模型路由): what the top-level `model`,
    `render_config`, `pools` and `obfuscation` are for the first one. Each base has its own
    tokenizer, render endpoint, engines, scheduler and admission ledger, and its own
    obfuscation secret; a request's `model` picks its base before anything is rendered."""

    model: ModelConfig
    render_config: RenderConfig = RenderConfig()
    pools: list[PoolConfig]
    obfuscation: ObfuscationConfig = ObfuscationConfig()


class TitoConfig(Section):
    listener: ListenerConfig = ListenerConfig()
    processor: ProcessorConfig = ProcessorConfig()
    render_config: RenderConfig = RenderConfig()
    derender: DerenderConfig = DerenderConfig()
    model: ModelConfig = ModelConfig()
    pools: list[PoolConfig] = Field(default_factory=lambda: [PoolConfig()])
    scheduler: SchedulerConfig = SchedulerConfig()
    admission: AdmissionConfig = AdmissionConfig()
    tenancy: TenancyConfig = TenancyConfig()
    reschedule: RescheduleConfig = RescheduleConfig()
    lora: LoraConfig = LoraConfig()
    obfuscation: ObfuscationConfig = ObfuscationConfig()
    capabilities: CapabilitiesConfig = CapabilitiesConfig()
    logging: LoggingConfig = LoggingConfig()
    tracing: TracingConfig = TracingConfig()
    conversation_store: ConversationStoreConfig = ConversationStoreConfig()
    local: LocalStackConfig = LocalStackConfig()
    models: list[BaseModelConfig] = Field(default_factory=list)  # more base models (the first is `model`)

    @model_validator(mode="after")
    def _pools_by_role(self) -> TitoConfig:
        for base in self.bases():
            roles = [p.role for p in base.pools]
            if len(set(roles)) != len(roles) or any(not p.instances and not p.discovery.dynamic for p in base.pools):
                raise ValueError("pools: at most one per role, each with at least one instance (or discovered)")
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
