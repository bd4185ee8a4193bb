"""Where a pool's engine instances come from: `pools[].discovery` of `TitoConfig`.

`static` is the pool's `instances` list, as before. `dns` and `kubernetes` discover them at
run time: instances join (probed by capability negotiation first) and leave (no new request;
what runs there finishes) while the gateway serves, and Envoy follows through the endpoints
file the processor writes (`listener.engine_endpoints_file`), without a restart.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ext_proc.config_section import Section

# llm-d's role label and its values (llm-d-router docs/disaggregation.md): which pools a pod
# of a P/D deployment serves in. A pod without the label serves a union pool.
ROLE_LABEL = "llm-d.ai/role"
ROLE_VALUES: dict[str, frozenset[str]] = {
    "union": frozenset({"prefill-decode", "encode-prefill-decode", "both"}),
    "prefill": frozenset({"prefill", "encode-prefill"}),
    "decode": frozenset({"decode", "encode-decode"}),
}


class DiscoveryConfig(Section):
    source: Literal["static", "dns", "kubernetes"] = "static"
    # Every discovered instance's engine port (dns; kubernetes with `selector`: an
    # InferencePool names its own target ports).
    port: int = 8000
    # What each discovered instance declares, as `instances[]` entries do: its decode mode,
    # and (with scheduler.prefix_source: kv_events) the port its KV cache events are
    # published on (replay on the next port up, as `tito up` starts engines).
    capabilities: list[Literal["prefill_handoff_decode", "concurrent_engine_sync", "decode_colocation"]] = Field(
        default_factory=list
    )
    kv_events_port: int | None = None
    # The most instances the pool grows to: Envoy's cluster-wide request limits are sized
    # for it (a static pool's for its list).
    max_instances: int = Field(default=16, ge=1)
    # -- dns: every A and AAAA record of `name` is an instance (a Kubernetes headless Service,
    # a compose service with replicas, Consul DNS); re-resolved as the records' TTL says,
    # within these bounds. A failed lookup keeps the last membership; a name with no records
    # (NXDOMAIN, no answer) has none.
    name: str = ""
    nameserver: str | None = None  # "host:port"; None: the system's resolvers (resolv.conf)
    min_refresh_s: float = Field(default=1.0, gt=0)
    max_refresh_s: float = Field(default=30.0, gt=0)
    timeout_s: float = Field(default=2.0, gt=0)
    # -- kubernetes: the Ready pods of an InferencePool (inference.networking.k8s.io/v1: its
    # selector and target ports), or of `selector` (matchLabels) with `port`, in `namespace`;
    # a P/D pool takes the pods whose `role_label` says its role.
    namespace: str = "default"
    inference_pool: str | None = None
    selector: dict[str, str] = Field(default_factory=dict)
    role_label: str = ROLE_LABEL
    # The API server: None: in the cluster (the pod's service account), else this URL (a
    # kubeconfig's server; tests: the API-server simulator) with `token_file` if any.
    api_url: str | None = None
    token_file: str | None = None
    # -- every dynamic source: an instance that leaves and comes back within
    # `flap_window_s` waits `flap_hold_s` (doubling per further flap, at most
    # `flap_hold_max_s`) before it routes again.
    flap_window_s: float = Field(default=30.0, ge=0)
    flap_hold_s: float = Field(default=2.0, ge=0)
    flap_hold_max_s: float = Field(default=60.0, ge=0)

    @model_validator(mode="after")
    def _source_named(self) -> DiscoveryConfig:
        if self.source == "dns" and not self.name:
            raise ValueError("discovery: source dns needs a name")
        if self.source == "kubernetes" and (self.inference_pool is None) == (not self.selector):
            raise ValueError("discovery: source kubernetes needs an inference_pool or a selector (not both)")
        if self.min_refresh_s > self.max_refresh_s:
            raise ValueError("discovery: min_refresh_s above max_refresh_s")
        return self

    @property
    def dynamic(self) -> bool:
        return self.source != "static"

    def serves(self, role: str, label: str | None) -> bool:
        """Whether a pod with this role label value belongs in a pool of `role`."""
        if label is None:
            return role == "union"
        return label in ROLE_VALUES[role]
