"""Which engines failed a routed leg and which answered, from what Envoy reports on the
response: hosts are tried in override_host order, one per attempt."""

from __future__ import annotations

from dataclasses import dataclass

ATTEMPT_COUNT_HEADER = "x-envoy-attempt-count"
# Added by Envoy to upstream responses (see envoy/envoy.yaml.j2); never shown to clients.
UPSTREAM_HOST_HEADER = "x-tito-upstream-host"


@dataclass(frozen=True)
class Verdict:
    failed: tuple[str, ...] = ()
    served_by: str | None = None


def engine_verdict(hosts: tuple[str, ...], headers: dict[str, str], served: str | None = None) -> Verdict:
    """`served`: the endpoint a GIE gateway reports (EPP protocol §Destination Endpoint
    Served), else the one tito's Envoy names in a response header."""
    if not hosts:  # nothing routed by the processor (passthrough): never breaker input
        return Verdict()
    attempts = min(int(headers.get(ATTEMPT_COUNT_HEADER, "1") or 1), len(hosts))
    upstream = served or headers.get(UPSTREAM_HOST_HEADER, "")
    status = int(headers.get(":status", "0") or 0)
    if upstream in hosts:
        before = hosts[: hosts.index(upstream)]
        if status >= 500:
            return Verdict((*before, upstream))
        return Verdict(before, upstream)
    if status in (502, 503, 504):  # Envoy's own reply: every attempt failed
        return Verdict(hosts[:attempts])
    return Verdict()
