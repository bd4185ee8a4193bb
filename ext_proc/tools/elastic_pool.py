"""`tito up`'s elastic local pool: engines behind a real DNS server, as a headless Service is.

A pool discovered by DNS whose name server is on this machine (`discovery.nameserver` on
127.0.0.0/8) is run by `tito up` itself: dnsmasq answers for the name from a hosts folder it
watches, engine k listens on its own loopback address 127.0.0.(11 + k) at the pool's port
(one name, one port, an A record each: the shape of a Kubernetes headless Service), and
`tito scale N` changes how many there are while the stack serves:

- up: engine k starts; once its /health answers, its record is published (dnsmasq rereads
  the folder at once) and the processor finds it on its next lookup;
- down: the last engine's record goes first, so the processor sends it nothing new; once it
  has no request running or waiting (its /metrics say so) it is stopped with SIGTERM.

`tito scale` writes the wanted size to the stack's run folder; `tito up` reads it between
its supervision steps and writes what each pool has (`pools.json`), which `tito scale` waits on.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ext_proc.config import InstanceConfig, PoolConfig, TitoConfig
from ext_proc.envoy_protocol.endpoints import write_atomically

# `tito up` with no pools in its config: one elastic pool of `local.replicas` engines.
LOCAL_POOL = {
    "name": "union",
    "role": "union",
    "discovery": {"source": "dns", "name": "engines.tito.test", "port": 8200, "nameserver": "127.0.0.1:8053"},
}
LOOPBACK_BASE = 11  # engine k of a pool listens on 127.0.0.(11 + k)
SCALE_FILE = "scale.json"  # {pool key: wanted size}, written by `tito scale`
STATE_FILE = "pools.json"  # {pool key: {"wanted": n, "listed": [...], "starting": [...], "draining": [...]}}
DRAIN_MIN_S = 2.0  # a leaving engine keeps serving at least this long after its record goes (lookups in flight)
DRAIN_MAX_S = 300.0  # ... and at most this long, waiting for its requests to finish


def elastic_by_default(config: TitoConfig) -> TitoConfig:
    """The config `tito up` runs: its pools, or with none configured the elastic local pool."""
    if "pools" in config.model_fields_set:
        return config
    return config.model_copy(update={"pools": [PoolConfig.model_validate(LOCAL_POOL)]})


def runs_locally(pool: PoolConfig) -> bool:
    """A DNS-discovered pool whose name server is on this machine: `tito up` runs it."""
    d = pool.discovery
    if d.source != "dns" or d.nameserver is None:
        return False
    host = d.nameserver.rpartition(":")[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def dnsmasq_command(nameserver: str, hosts_dir: Path, names: list[str]) -> list[str]:
    """dnsmasq answering only from the hosts folder (reread on every change), authoritative
    for the pools' domains (an unknown name is NXDOMAIN, not a query sent elsewhere), with a
    TTL of 1 s so a lookup's answer is not held longer than the processor re-resolves."""
    host, _, port = nameserver.rpartition(":")
    domains = sorted({name.split(".", 1)[1] if "." in name else name for name in names})
    return [
        shutil.which("dnsmasq") or "/usr/sbin/dnsmasq",  # (Debian puts it in sbin)
        "--keep-in-foreground",
        "--no-resolv",
        "--no-hosts",
        "--no-poll",
        f"--hostsdir={hosts_dir}",
        f"--listen-address={host.strip('[]')}",
        f"--port={port}",
        "--bind-interfaces",
        "--local-ttl=1",
        "--pid-file=",  # none: `tito up` supervises it
        "--log-facility=-",
        *(f"--local=/{domain}/" for domain in domains),
        # as root it would switch to `nobody`, who may not read the hosts folder
        *(["--user=root", "--group=root"] if os.geteuid() == 0 else []),
    ]


@dataclass
class ElasticPool:
    """One locally run discovered pool: its engines are `<prefix>0`, `<prefix>1`, ..."""

    key: str  # the pool's name (a further base model's: "<served name>/<pool>")
    base: TitoConfig
    pool: PoolConfig
    prefix: str
    wanted: int
    size: int = 0  # engines started: 0 .. size - 1
    listed: set[int] = field(default_factory=set)  # engines whose record is published
    draining: dict[int, float] = field(default_factory=dict)  # engine -> when its record went

    def name(self, k: int) -> str:
        return f"{self.prefix}{k}"

    def instance(self, k: int) -> InstanceConfig:
        return self.pool.discovered(f"127.0.0.{LOOPBACK_BASE + k}", self.pool.discovery.port)

    def engines(self) -> list[tuple[str, InstanceConfig]]:
        return [(self.name(k), self.instance(k)) for k in range(self.size)]

    def records(self) -> str:
        """The hosts-file lines of the published engines."""
        name = self.pool.discovery.name
        return "".join(f"{self.instance(k).host} {name}\n" for k in sorted(self.listed))

    def describe(self) -> dict[str, object]:
        return {
            "wanted": self.wanted,
            "listed": [self.instance(k).address for k in sorted(self.listed)],
            "starting": [
                self.instance(k).address for k in range(self.size) if k not in self.listed | self.draining.keys()
            ],
            "draining": [self.instance(k).address for k in sorted(self.draining)],
        }


def idle(instance: InstanceConfig) -> bool:
    """The engine runs and queues no request (vLLM's own gauges), or nothing listens there any
    more. One too busy to answer within the timeout is not idle."""
    try:
        text = httpx.get(instance.url + "/metrics", timeout=2, trust_env=False).text
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    busy = 0.0
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            busy += float(line.rsplit(" ", 1)[1])
    return busy == 0


def read_scale(run_dir: Path) -> dict[str, int]:
    try:
        return {str(k): int(v) for k, v in json.loads((run_dir / SCALE_FILE).read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def request_scale(run_dir: Path, pool: str, size: int) -> None:
    wanted = read_scale(run_dir) | {pool: size}
    write_atomically(run_dir / SCALE_FILE, json.dumps(wanted).encode())


def read_state(run_dir: Path) -> dict[str, dict[str, object]]:
    try:
        state = json.loads((run_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def wait_scaled(run_dir: Path, pool: str, size: int, admin_url: str, timeout_s: float) -> list[str] | None:
    """Until the pool lists `size` engines, none starts or drains, and the processor routes
    to exactly those (None: timed out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = read_state(run_dir).get(pool)
        if state is not None and len(state["listed"]) == size and not state["starting"] and not state["draining"]:  # type: ignore[arg-type]
            listed = sorted(state["listed"])  # type: ignore[call-overload]
            if routes(admin_url, pool) == listed:
                return listed
        time.sleep(0.5)
    return None


def routes(admin_url: str, pool: str) -> list[str] | None:
    """The pool's instances the processor routes to (None: it does not answer)."""
    try:
        state = httpx.get(admin_url + "/debug/state", timeout=2, trust_env=False).json()
    except (httpx.HTTPError, ValueError):
        return None
    instances = state.get("pools", {}).get(pool, {}).get("instances", {})
    return sorted(address for address, why in instances.items() if why == "routes")
