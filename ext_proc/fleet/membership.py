"""Runtime membership: one base model's engine instances as they join and leave its pools.

A static pool's instances are its config's, members from the start. A discovered pool's
come from its source (`fleet/discovery/`), which publishes the pool's whole membership on
every change; this module turns each publication into joins and leaves, in the order they
were published (one writer per process, as llm-d's discovery notifier requires):

- join: the scheduler takes the instance (held out until its capability record is complete,
  with negotiation on), capability negotiation probes it at once, and its own background
  work starts (metrics scrape, KV-event subscription);
- leave: the instance takes no new leg at once; what runs there finishes (or relays if the
  engine dies, as always); its breaker, records, index blocks, adapter listing, scrape and
  subscription go; leases of legs still running there are released as those legs finish;
- an instance that comes back soon after leaving is a flap: it waits before routing again,
  longer at each further flap (`FlapDamper`).

Nothing on the request path waits for any of it: planning reads the scheduler as it is.
Every processor worker and replica runs its own sources and converges by itself; `on_change`
(the endpoints file Envoy reads) is told the members after every change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx

from ext_proc.config import InstanceConfig, PoolConfig, TitoConfig
from ext_proc.fleet.capabilities import Capabilities
from ext_proc.fleet.discovery import Found, Source, source_for
from ext_proc.fleet.engine_metrics import EngineMetricsPoller
from ext_proc.fleet.kv_events import KvEventSubscriber
from scheduler import Capability, Instance, Role, Scheduler

log = logging.getLogger("tito.membership")

# What an instance runs beside the requests it serves (a metrics scrape, a KV-event
# subscription): started when it joins, cancelled when it leaves.
SideWork = Callable[[PoolConfig, InstanceConfig], list[Coroutine[Any, Any, None]]]


def instance_work(config: TitoConfig, scheduler: Scheduler, http: httpx.AsyncClient) -> SideWork:
    """What each instance runs: its KV-event subscription when events feed the prefix index
    (and it publishes them), its metrics scrape when the engines' metrics are a load source."""
    s = config.scheduler

    def work(pool: PoolConfig, instance: InstanceConfig) -> list[Coroutine[Any, Any, None]]:
        out = []
        if s.prefix_source == "kv_events" and instance.kv_events is not None:
            out.append(KvEventSubscriber(instance.address, instance.kv_events, scheduler, pool.block_size).run())
        if s.load_source == "engine_metrics":  # (an answer slower than the stale time would be stale on arrival)
            poller = EngineMetricsPoller(
                instance.address, scheduler, http, s.engine_metrics_interval_s, s.engine_metrics_stale_s
            )
            out.append(poller.run())
        return out

    return work


@dataclass
class FlapDamper:
    """How long a joining instance waits before it routes: nothing the first time, or when it
    left longer than `window_s` ago; else `hold_s`, doubling with each further flap up to
    `hold_max_s` (an instance that keeps coming and going costs a probe each time and loses
    requests to connection errors)."""

    window_s: float
    hold_s: float
    hold_max_s: float
    _left: dict[str, float] = field(default_factory=dict)  # address -> when it last left
    _flaps: dict[str, int] = field(default_factory=dict)

    def left(self, address: str, now: float) -> None:
        self._left[address] = now

    def hold(self, address: str, now: float) -> float:
        left = self._left.get(address)
        if left is None or now - left > self.window_s:
            self._flaps.pop(address, None)
            return 0.0
        flaps = self._flaps[address] = self._flaps.get(address, 0) + 1
        return min(self.hold_s * 2 ** (flaps - 1), self.hold_max_s)


@dataclass
class _Pending:
    due: float
    pool: PoolConfig
    instance: InstanceConfig


class Membership:
    def __init__(
        self,
        config: TitoConfig,
        scheduler: Scheduler,
        capabilities: Capabilities | None,
        side_work: SideWork,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._scheduler = scheduler
        self._capabilities = capabilities
        self._side_work = side_work
        self._clock = clock
        self.on_change: Callable[[], None] = lambda: None
        self.members: dict[str, tuple[PoolConfig, InstanceConfig]] = {
            i.address: (p, i) for p in config.pools for i in p.instances
        }
        self._published: dict[str, dict[str, Found]] = {}  # each discovered pool's last publication
        self._pending: dict[str, _Pending] = {}  # damped joins
        self._dampers = {
            p.name: FlapDamper(p.discovery.flap_window_s, p.discovery.flap_hold_s, p.discovery.flap_hold_max_s)
            for p in config.pools
        }
        self._work: dict[str, list[asyncio.Task[None]]] = {}
        self.joins: dict[str, int] = dict.fromkeys(self._dampers, 0)
        self.leaves: dict[str, int] = dict.fromkeys(self._dampers, 0)
        self._wake = asyncio.Event()

    # -- what sources publish

    def publish(self, pool: PoolConfig, found: frozenset[Found]) -> None:
        """The pool's membership now: who is gone leaves, who is new joins (or waits, if it
        flaps). An engine is in one pool at a time: one that moves (a pod relabelled from
        decode to prefill, published by both pools in either order) joins its new pool once
        its old one has let it go."""
        now = self._clock()
        self._published[pool.name] = wanted = {f.address: f for f in found}
        here = {a for a, (p, _) in self.members.items() if p.name == pool.name}
        here |= {a for a, pending in self._pending.items() if pending.pool.name == pool.name}
        for address in sorted(here - wanted.keys()):
            self._leave(address, now)
        self._admit(now)

    def _admit(self, now: float) -> None:
        """Every published instance in no pool yet joins, or waits if it flaps."""
        for pool in self._config.pools:
            for address, found in sorted(self._published.get(pool.name, {}).items()):
                if address in self.members or address in self._pending:
                    continue
                instance = pool.discovered(found.host, found.port)
                hold = self._dampers[pool.name].hold(address, now)
                if hold > 0:
                    log.warning(
                        "engine %s (pool %s) is back soon after leaving: routes in %.1f s", address, pool.name, hold
                    )
                    self._pending[address] = _Pending(now + hold, pool, instance)
                    self._wake.set()
                else:
                    self._join(pool, instance)

    def _join(self, pool: PoolConfig, instance: InstanceConfig) -> None:
        address = instance.address
        role = Role(pool.role)
        default = {Capability.HANDOFF} if role is Role.DECODE else set()
        capabilities = frozenset(Capability(c) for c in instance.capabilities) or frozenset(default)
        self.members[address] = (pool, instance)
        self._scheduler.join(Instance(address, pool.name, role, capabilities))
        if self._capabilities is not None:
            self._capabilities.join(pool, instance)
        self._start_work(pool, instance)
        self.joins[pool.name] += 1
        log.info("engine %s joined pool %s (%s)", address, pool.name, pool.discovery.source)
        self.on_change()

    def _leave(self, address: str, now: float) -> None:
        if self._pending.pop(address, None) is not None:
            return  # it never routed
        pool, _ = self.members.pop(address)
        self._scheduler.leave(address)
        if self._capabilities is not None:
            self._capabilities.leave(address)
        for task in self._work.pop(address, []):
            task.cancel()
        self._dampers[pool.name].left(address, now)
        self.leaves[pool.name] += 1
        running = self._scheduler.ledger.active_requests(address)
        log.info("engine %s left pool %s; %d legs still finish there", address, pool.name, running)
        self.on_change()

    def _start_work(self, pool: PoolConfig, instance: InstanceConfig) -> None:
        self._work[instance.address] = [asyncio.create_task(w) for w in self._side_work(pool, instance)]

    # -- running

    async def run(self) -> None:
        """The static members' side work, every discovered pool's source, and the damped
        joins as they fall due; until cancelled."""
        for pool, instance in list(self.members.values()):
            self._start_work(pool, instance)
        sources = [(pool, source) for pool in self._config.pools if (source := source_for(pool)) is not None]
        tasks = [asyncio.create_task(self._follow(pool, source)) for pool, source in sources]
        try:
            await self._join_when_due()
        finally:
            for task in [*tasks, *(t for work in self._work.values() for t in work)]:
                task.cancel()
            await asyncio.gather(*tasks, *(t for work in self._work.values() for t in work), return_exceptions=True)

    async def _follow(self, pool: PoolConfig, source: Source) -> None:
        await source.run(lambda found: self.publish(pool, found))

    async def _join_when_due(self) -> None:
        while True:
            self._wake.clear()
            now = self._clock()
            for address, pending in sorted(self._pending.items()):
                if pending.due <= now:
                    del self._pending[address]
                    self._join(pending.pool, pending.instance)
            wait = min((p.due for p in self._pending.values()), default=now + 3600) - now
            # (asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
            # arrives with the wake-up, and the loop would never end)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(wait, 0.0)):
                    await self._wake.wait()

    # -- what operators see

    def snapshot(self) -> dict[str, Any]:
        """Each pool: its source, and each instance with why it routes or not."""
        held_out = self._scheduler.held_out
        pools: dict[str, Any] = {}
        for pool in self._config.pools:
            instances: dict[str, str] = {}
            for address, (p, _) in self.members.items():
                if p.name == pool.name:
                    instances[address] = "routes" if address not in held_out else f"held out: {held_out[address]}"
            for address, pending in self._pending.items():
                if pending.pool.name == pool.name:
                    instances[address] = f"damped: routes in {max(pending.due - self._clock(), 0):.1f} s"
            pools[pool.name] = {
                "source": pool.discovery.source,
                "instances": instances,
                "joins": self.joins[pool.name],
                "leaves": self.leaves[pool.name],
            }
        return pools

    def empty_pools(self) -> list[PoolConfig]:
        """The pools without a member now."""
        held = {p.name for p, _ in self.members.values()}
        return [pool for pool in self._config.pools if pool.name not in held]

    def addresses(self) -> list[tuple[str, int]]:
        """(host, port) of every member (the endpoints Envoy may send to)."""
        return [(i.host, i.port) for _, i in self.members.values()]
