"""The config of how requests are placed on engines and whether an engine takes them: the
scheduler (policy, prefix index, load source, breaker), admission (token budgets), relay
rescheduling, LoRA adapter placement and capability negotiation. They are the `scheduler`,
`admission`, `reschedule`, `lora` and `capabilities` sections of `TitoConfig`
(`ext_proc/config.py`), gateway-wide sections kept apart from the per-base-model ones
(model, render, pools, obfuscation) that stay in `config.py` with `TitoConfig` itself.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ext_proc.config_section import Section


class LoraConfig(Section):
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


class BreakerSettings(Section):
    failure_threshold: int = 3  # consecutive engine failures that open an instance's breaker
    base_cooldown_s: float = 5.0  # first open period; doubles after each failed half-open probe
    max_cooldown_s: float = 60.0
    # Every breaker of a pool open: route as if none were (Envoy's panic routing) instead of
    # refusing every request with 503 until a half-open probe succeeds.
    panic_when_all_open: bool = True


class SchedulerConfig(Section):
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


class RescheduleConfig(Section):
    """Relay (RFC 流式 replay 与重调度): a streaming single-prompt request whose engine fails
    mid-stream goes on on another instance from the ids the client already has. When on,
    those requests take the processor-owned path (the processor runs the engine stream)."""

    enable: bool = False
    max_attempts: int = 3  # engine streams per request, the first included
    first_token_timeout_s: float = 60.0  # no first event this long: the engine is stalled
    inter_token_timeout_s: float = 30.0  # no next event this long: the engine is stalled


class AdmissionConfig(Section):
    """Token budgets (prompt tokens + max_tokens of every active request); None is unlimited.

    The budgets are the whole gateway's. Every processor process (`replicas` gateways with
    `processor.workers` each) enforces an equal share, rounded down, on its own ledger: the
    shares never add up to more than the budget, whichever process Envoy picks, with no
    coordination on the request path. A request larger than one share is refused (429).
    """

    global_token_budget: int | None = None
    instance_token_budget: int | None = None
    replicas: int = Field(default=1, ge=1)  # gateway replicas (hosts) sharing these engines
    # Flow control (docs/flow-control.md): a request that does not fit waits this long in a
    # queue, highest priority band first, fair share across flows within a band (weighted, in
    # the tokens admission charges); then 429 with Retry-After. 0: refused at once (429).
    queue_timeout_s: float = Field(default=0.0, ge=0)
    queue_max_requests: int = Field(default=1024, ge=1)  # waiting at once, per process
    queue_max_tokens: int | None = None  # their admission demand summed, per process
    # While several flows are active (in flight, waiting, or seen within this), each holds at
    # most its weighted share of the token budget: a flood leaves the others' shares free.
    flow_active_s: float = Field(default=5.0, gt=0)
    # A request's flow: its API key's tenant, else this header (llm-d's name), else "default".
    fairness_header: str = "x-llm-d-inference-fairness-id"
    # Its priority: its tenant's, else the objective this header names (llm-d's name) from
    # `objectives` (name -> priority; below 0 is sheddable: shed first), else 0.
    objective_header: str = "x-llm-d-inference-objective"
    objectives: dict[str, int] = Field(default_factory=dict)
    # Engines saturated (every engine of the pool past one of these, from their metrics):
    # new requests queue even when the token budget has room. None: the budget alone.
    saturation_kv_cache_usage: float | None = Field(default=None, gt=0, le=1)
    saturation_waiting_requests: int | None = Field(default=None, ge=0)
    # While the highest band's next request is kept out by capacity (the budget or saturated
    # engines), end sheddable requests of a lower band in flight (llm-d's `enableEviction`):
    # the lowest band's newest first, at most this many per decision, their clients told
    # (429 `evicted`, or a stream's error event), their tokens back. False: never.
    evict_sheddable: bool = False
    max_evictions_per_decision: int = Field(default=2, ge=1)


class CapabilitiesConfig(Section):
    """Capability negotiation (RFC 能力协商): before a client request pays for it, the gateway
    learns what every engine and render endpoint serves (`ext_proc/fleet/capabilities.py`):
    version, models, max_model_len, LoRA adapters, KV block size and hash, KV event sources,
    whether token-only generate is live (an engine without it is served natively from its
    first request), whether its tokenizer agrees with render's (a canary chat rendered
    and tokenized), and the `system_fingerprint` its native answers carry. An engine routes once its record is complete, and stops at once when a
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
    # failed on it; one that fails it (no connection, a 5xx, or no answer within
    # health_timeout_s `health_timeouts` times in a row) stops routing at once and is probed
    # with the backoff above, and its first passing check after that brings on the full
    # probe at once. A saturated engine's server answers late (measured: 64 streams on two
    # cores), a hung one never: one late answer is not a death (three times as many while
    # the engine has legs running).
    health_interval_s: float = Field(default=1.0, gt=0)
    health_timeout_s: float = Field(default=1.0, gt=0)  # per liveness check
    health_timeouts: int = Field(default=3, ge=1)
    # the `system_fingerprint` native answers carry, put on the gateway's where native puts it:
    # asked of each union engine once per record with one token generated for a few random
    # ones (off: the gateway's answers carry none; prefill and decode engines are never asked)
    fingerprint: bool = True
