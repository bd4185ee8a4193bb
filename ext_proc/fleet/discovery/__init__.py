"""Membership sources: where a discovered pool's instances come from (`pools[].discovery`).

A source runs for as long as the processor does and publishes the pool's whole membership
each time it changes (level, not edge: a missed change is mended by the next publication).
It never raises for what it reads: an unreachable name server or API server keeps the last
membership published and is tried again. Applying a publication (probing joiners, releasing
leavers, damping flaps) is `fleet/membership.py`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ext_proc.config import PoolConfig


@dataclass(frozen=True, order=True)
class Found:
    """One discovered instance: an IP (an IPv6 one in brackets, as in a URL) and a port."""

    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


Publish = Callable[[frozenset[Found]], None]


class Source(Protocol):
    async def run(self, publish: Publish) -> None:
        """Publish the membership now and whenever it changes, until cancelled."""


def source_for(pool: PoolConfig) -> Source | None:
    """The pool's source (None: a static pool, whose instances are its config's)."""
    discovery = pool.discovery
    if discovery.source == "dns":
        from ext_proc.fleet.discovery.dns import DnsSource

        return DnsSource(discovery)
    if discovery.source == "kubernetes":
        from ext_proc.fleet.discovery.kubernetes import KubernetesSource

        return KubernetesSource(discovery, pool.role)
    return None


async def discover_once(pool: PoolConfig, timeout_s: float = 10.0) -> frozenset[Found]:
    """The pool's first publication (a static pool, or none within `timeout_s`: nothing)."""
    source = source_for(pool)
    if source is None:
        return frozenset()
    first: asyncio.Future[frozenset[Found]] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(source.run(lambda found: first.done() or first.set_result(found)))
    try:
        return await asyncio.wait_for(first, timeout_s)
    except TimeoutError:
        return frozenset()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
