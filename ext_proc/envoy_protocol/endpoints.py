"""The engines' cluster as Envoy's EDS reads it from a file, when a pool is discovered.

Why a file and not a STATIC host list, STRICT_DNS or ORIGINAL_DST (measured: docs/scale-out.md
"Elastic pools"): the processor picks the engine and names it, with its
ordered fallbacks, in `envoy.lb` metadata for `override_host`, which skips an address that is
not a member of the cluster. So Envoy's members must be exactly the processor's: STRICT_DNS
would resolve on its own clock (and cannot follow Kubernetes pods), ORIGINAL_DST reads one
address (no fallback on a retry) and keeps no per-host circuit breakers or health checks.
The processor writes the members it routes to; Envoy watches the folder and applies a new
file within milliseconds, with no restart and its existing connections kept.

The file is replaced whole by a rename (Envoy's `watched_directory` reloads on a move into
the folder, never reading a half-written file).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import orjson

CLUSTER = "engines"
LOAD_ASSIGNMENT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def load_assignment(members: Iterable[tuple[str, int]], version: int) -> bytes:
    """A DiscoveryResponse holding the cluster's ClusterLoadAssignment (what a path EDS
    source reads)."""
    endpoints = [
        {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
        for host, port in sorted({(host.strip("[]"), port) for host, port in members})
    ]
    resource = {"@type": LOAD_ASSIGNMENT, "cluster_name": CLUSTER, "endpoints": [{"lb_endpoints": endpoints}]}
    return orjson.dumps({"version_info": str(version), "resources": [resource]})


class EndpointsFile:
    """Writes the members to `path` whenever they change (the same set twice: once)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._last: frozenset[tuple[str, int]] | None = None
        self.version = 0

    def write(self, members: Iterable[tuple[str, int]]) -> bool:
        current = frozenset(members)
        if current == self._last:
            return False
        self.version += 1
        write_atomically(self.path, load_assignment(current, self.version))
        self._last = current
        return True


def write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
