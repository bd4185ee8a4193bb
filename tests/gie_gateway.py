"""A Gateway API Inference Extension gateway in front of tito, as GIE gateways configure Envoy
for an InferencePool (GIE's former reference `test/testdata/envoy.yaml`, llm-d-router's e2e
`envoy.yaml`, Envoy AI Gateway's `inferencepool.go`: see the shared research note §1, §4), and
nothing of tito's own bootstrap: the processor is called as the pool's endpoint picker.

- ext_proc with request/response headers SEND, bodies FULL_DUPLEX_STREAMED, trailers SEND (or
  the modes a test asks for), fail closed, a gRPC health check of the picker's cluster on
  `envoy.service.ext_proc.v3.ExternalProcessor`.
- The pool's cluster, one of:
  - `original_dst`: ORIGINAL_DST on the `x-gateway-destination-endpoint` header (the
    reference config; one address, so the picker must name one);
  - `override_host`: the members listed (as a gateway with the pool's endpoints does), the
    pick read from `envoy.lb` metadata or the header, a retry walks the ordered list.
- The data plane's side of the protocol, declared as gateways do it:
  - the subset hint: a HeaderToMetadata rule turns the test's `x-test-endpoint-subset`
    header into `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset` (one
    comma-separated string, as lwepp documents), forwarded to the picker;
  - the served report: the route stamps `%UPSTREAM_HOST%` on the response and a
    HeaderToMetadata rule moves it into `envoy.lb` / `x-gateway-destination-endpoint-served`
    before the picker sees the response headers (the header itself is removed).
- No local-reply formatting, no attempt-count header, no `x-tito-upstream-host`."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

SUBSET_HEADER = "x-test-endpoint-subset"
SERVED_HEADER = "x-test-served-endpoint"


def _ext_proc(processor_port: int, request_body: str, response_body: str) -> dict[str, object]:
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
            "failure_mode_allow": False,
            "message_timeout": "1000s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": request_body,
                "request_trailer_mode": "SEND",
                "response_header_mode": "SEND",
                "response_body_mode": response_body,
                "response_trailer_mode": "SEND",
            },
            "metadata_options": {
                "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint", "envoy.lb"]},
                "receiving_namespaces": {"untyped": ["envoy.lb"]},
            },
        },
    }


def _header_to_metadata(direction: str, header: str, namespace: str, key: str) -> dict[str, object]:
    rule = {"header": header, "on_header_present": {"metadata_namespace": namespace, "key": key, "type": "STRING"}}
    return {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
            direction: [{**rule, "remove": True}],
        },
    }


def _pool_cluster(kind: str, members: list[tuple[str, int]]) -> dict[str, object]:
    base: dict[str, object] = {
        "name": "pool",
        "connect_timeout": "1s",
        "circuit_breakers": {
            "thresholds": [
                {"max_connections": 40000, "max_pending_requests": 40000, "max_requests": 40000, "max_retries": 40000}
            ]
        },
    }
    if kind == "original_dst":
        return base | {
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": "x-gateway-destination-endpoint"},
        }
    override = {
        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
        "override_host_sources": [
            {"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}},
            {"header": "x-gateway-destination-endpoint"},
        ],
        "fallback_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.random",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.random.v3.Random"
                        },
                    }
                }
            ]
        },
    }
    endpoints = [{"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}} for h, p in members]
    return base | {
        "type": "STATIC",
        "load_assignment": {"cluster_name": "pool", "endpoints": [{"lb_endpoints": endpoints}]},
        "load_balancing_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": override,
                    }
                }
            ]
        },
    }


def bootstrap(
    port: int,
    admin_port: int,
    processor_port: int,
    kind: str,
    members: list[tuple[str, int]],
    request_body: str = "FULL_DUPLEX_STREAMED",
    response_body: str = "FULL_DUPLEX_STREAMED",
) -> dict[str, object]:
    route: dict[str, object] = {"cluster": "pool", "timeout": "0s", "idle_timeout": "300s"}
    if kind == "override_host":  # the proxy walks the picker's list on a retry (EPP protocol)
        route["retry_policy"] = {
            "retry_on": "connect-failure,refused-stream,reset,retriable-status-codes",
            "retriable_status_codes": [503],
            "num_retries": 2,
            "retry_host_predicate": [
                {
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                    },
                }
            ],
            "host_selection_retry_max_attempts": 5,
        }
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gie",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "route": route,
                            "response_headers_to_add": [
                                {
                                    "header": {"key": SERVED_HEADER, "value": "%UPSTREAM_HOST%"},
                                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                                }
                            ],
                        }
                    ],
                }
            ]
        },
        "http_filters": [
            _header_to_metadata(
                "request_rules", SUBSET_HEADER, "envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset"
            ),
            _ext_proc(processor_port, request_body, response_body),
            _header_to_metadata("response_rules", SERVED_HEADER, "envoy.lb", "x-gateway-destination-endpoint-served"),
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
            },
        ],
    }
    epp = {
        "name": "epp",
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "health_checks": [
            {
                "timeout": "2s",
                "interval": "1s",
                "no_traffic_interval": "1s",
                "unhealthy_threshold": 3,
                "healthy_threshold": 1,
                "grpc_health_check": {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"},
            }
        ],
        "load_assignment": {
            "cluster_name": "epp",
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {"socket_address": {"address": "127.0.0.1", "port_value": processor_port}}
                            }
                        }
                    ]
                }
            ],
        },
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "gie",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                    "filter_chains": [
                        {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
                    ],
                }
            ],
            "clusters": [_pool_cluster(kind, members), epp],
        },
    }


@dataclass
class GieEnvoy:
    """One GIE-style Envoy, running: `base_url` for clients, `stop()` when done."""

    port: int
    admin_port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stat(self, name: str) -> int:
        text = httpx.get(f"http://127.0.0.1:{self.admin_port}/stats?filter={name}", timeout=5, trust_env=False).text
        values = [int(line.split(": ")[1]) for line in text.splitlines() if line.split(": ")[0] == name]
        return values[0] if values else 0

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _healthy(envoy: GieEnvoy) -> bool:
    try:
        return envoy.stat("cluster.epp.membership_healthy") >= 1
    except httpx.HTTPError:  # its admin port not open yet
        return False


def start_gie_envoy(
    envoy_bin: Path,
    work: Path,
    port: int,
    admin_port: int,
    processor_port: int,
    kind: str,
    members: list[tuple[str, int]],
    **modes: str,
) -> GieEnvoy:
    """Started and ready: its picker cluster healthy (the processor's gRPC health says so)."""
    work.mkdir(parents=True, exist_ok=True)
    config = work / f"gie-{kind}.yaml"
    config.write_text(yaml.safe_dump(bootstrap(port, admin_port, processor_port, kind, members, **modes)))
    log_path = work / f"gie-{kind}.log"
    command = [str(envoy_bin), "-c", str(config), "--log-level", "warn", "--disable-hot-restart"]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    envoy = GieEnvoy(port, admin_port, process, log_path)
    deadline = time.monotonic() + 30
    try:
        while not _healthy(envoy):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the GIE-style Envoy did not come up: {log_path.read_text()[-2000:]}")
            time.sleep(0.2)
    except BaseException:  # (an interrupted wait too: no Envoy left behind)
        envoy.stop()
        raise
    return envoy
