"""API keys: each a tenant with a priority, a weight, allowed models and a token quota, from a
YAML file (a mounted Kubernetes Secret works as is) read again when it changes. Keys are
stored as SHA-256 hashes and a presented key is compared against every stored hash in
constant time; no key, hashed or not, is ever logged.

    tenants:
    - name: team-a
      priority: 0              # its requests' band (below 0: sheddable)
      weight: 1                # its share within the band
      models: [tiny]           # empty or absent: every model
      tokens_per_minute: 200000
      keys: ["sha256:9f86d0..."]   # `tito hash-key` prints one
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger("tito.tenancy")
PREFIX = "sha256:"


def hash_key(key: str) -> str:
    """How a key is stored: never the key itself."""
    return PREFIX + hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Tenant:
    name: str
    priority: int = 0
    weight: float = 1.0
    models: frozenset[str] = frozenset()  # empty: every model
    tokens_per_minute: int | None = None

    def allows(self, model: str | None) -> bool:
        return not self.models or model in self.models


def parse_keys(text: str) -> list[tuple[bytes, Tenant]]:
    """The file's tenants and their hashed keys (ValueError: not a keys file)."""
    raw: Any = yaml.safe_load(text) or {}
    entries: list[tuple[bytes, Tenant]] = []
    for item in raw.get("tenants", []):
        tenant = Tenant(
            name=str(item["name"]),
            priority=int(item.get("priority", 0)),
            weight=float(item.get("weight", 1.0)),
            models=frozenset(str(m) for m in item.get("models") or ()),
            tokens_per_minute=item.get("tokens_per_minute"),
        )
        if tenant.weight <= 0:
            raise ValueError(f"tenant {tenant.name}: weight must be above 0")
        for stored in item.get("keys", []):
            if not str(stored).startswith(PREFIX):
                raise ValueError(f"tenant {tenant.name}: keys are stored hashed ({PREFIX}<hex>, `tito hash-key`)")
            entries.append((str(stored).encode(), tenant))
    return entries


class ApiKeys:
    def __init__(self, path: str, reload_s: float) -> None:
        self._path = Path(path)
        self._reload_s = reload_s
        self._hashes: list[tuple[bytes, Tenant]] = []
        self._stamp: tuple[float, int] | None = None
        self.load()

    def load(self) -> None:
        """Read the file if it changed; a broken file keeps the keys read before (logged)."""
        try:
            stat = self._path.stat()
            if (stat.st_mtime, stat.st_size) == self._stamp:
                return
            entries = parse_keys(self._path.read_text())
        except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError) as error:
            log.warning("API keys file %s not read (%s); the keys read before stay", self._path, type(error).__name__)
            return
        self._hashes, self._stamp = entries, (stat.st_mtime, stat.st_size)
        tenants = len({t.name for _, t in entries})
        log.info("API keys: %d keys of %d tenants from %s", len(entries), tenants, self._path)

    def tenant(self, key: str) -> Tenant | None:
        """The key's tenant, or None (unknown or revoked). Every stored hash is compared, in
        constant time each, so the answer's timing says nothing of which key came close."""
        presented = hash_key(key).encode()
        found: Tenant | None = None
        for stored, tenant in self._hashes:
            if hmac.compare_digest(presented, stored):
                found = tenant
        return found

    async def run(self) -> None:
        """Follow the file: a key revoked there stops working within `reload_s`."""
        while True:
            await asyncio.sleep(self._reload_s)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.load)
