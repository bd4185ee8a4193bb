"""Capability negotiation for engines that join and leave while the gateway serves
(`Capabilities.join` / `.leave`): a joiner is probed at once and routes once its record is
complete; a leaver's record, verdict, listing and due probes go, and a probe or liveness check
of it still running when it left records nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest

from ext_proc.config import TitoConfig
from ext_proc.fleet.capabilities import Capabilities
from ext_proc.fleet.discovery import Found
from ext_proc.fleet.membership import Membership
from ext_proc.frontend.model_catalog import ModelCatalog
from ext_proc.frontend.tokenization import LocalTokenizer, TokenizationService
from ext_proc.server import build_scheduler
from scheduler import Instance, Pick, Role, Scheduler, ScheduleRequest
from scheduler.dispatch import NO_RECORD
from tests.unit.test_capabilities import FINGERPRINT, _Engines, wait_until

NEW = "10.0.0.5:8200"


def _config(**capabilities: object) -> TitoConfig:
    return TitoConfig.model_validate(
        {
            "render_config": {"enable": False},
            "pools": [{"discovery": {"source": "dns", "name": "engines.test", "port": 8200}}],
            "capabilities": {"retry_min_s": 0.5, "retry_max_s": 30, "interval_s": 30, **capabilities},
            "scheduler": {"prefix_source": "routing"},
        }
    )


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Held:
    """The mock engines, except that a request to a host in `held` waits for `release`."""

    def __init__(self) -> None:
        self.engines = _Engines()
        self.held: set[str] = set()
        self.waiting = 0
        self.release = asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if f"{request.url.host}:{request.url.port}" in self.held:
            self.waiting += 1
            await self.release.wait()
        return self.engines(request)


class _Setup:
    def __init__(
        self, http: httpx.AsyncClient, config: TitoConfig | None = None, clock: Callable[[], float] | None = None
    ) -> None:
        self.config = config or _config()
        self.scheduler: Scheduler = build_scheduler(self.config, gated=True)
        self.catalog = ModelCatalog(self.config.model)
        self.clock = _Clock() if clock is None else clock
        self.capabilities = Capabilities(
            self.config,
            self.scheduler,
            TokenizationService(None, LocalTokenizer(None)),
            http,
            clock=self.clock,
            catalog=self.catalog,
        )
        self.pool = self.config.pools[0]

    def join(self, address: str = NEW) -> None:
        """What `Membership._join` does for the two of them."""
        host, port = address.rsplit(":", 1)
        instance = self.pool.discovered(host, int(port))
        self.scheduler.join(Instance(address, self.pool.name, Role.UNION))
        self.capabilities.join(self.pool, instance)

    def leave(self, address: str = NEW) -> None:
        self.scheduler.leave(address)
        self.capabilities.leave(address)

    def gone(self, address: str = NEW) -> bool:
        """Nothing of the engine is left in negotiation, nor in what it decided."""
        c = self.capabilities
        return (
            address not in c.engines
            and address not in c.assessments
            and address not in c._due
            and address not in c._health_due
            and address not in c._down
            and address not in c.snapshot()["engines"]
            and address not in self.scheduler.held_out
            and not self.catalog.serves("sql-lora")
            and self.scheduler.lora.holders("sql-lora") == set()
            and self.catalog.system_fingerprint() is None
        )


async def test_a_joined_engine_is_probed_at_once_and_routes_once_its_record_is_complete() -> None:
    engines = _Engines()
    async with httpx.AsyncClient(transport=httpx.MockTransport(engines)) as http:
        s = _Setup(http)
        s.join()
        c, now = s.capabilities, s.clock()
        assert c.engines == {NEW: None} and c._due[NEW].at == now  # due now, not at the next round
        assert c._health_due[NEW] == now + s.config.capabilities.health_interval_s
        assert s.scheduler.held_out == {NEW: NO_RECORD} and c.describe_engine(NEW) == {"complete": False}
        await c.refresh([NEW])
        record = c.engines[NEW]
        assert record is not None and record.complete and c.assessments[NEW].routes
        assert s.scheduler.held_out == {} and c.ready() and c._due[NEW].at == now + 30
        assert s.catalog.serves("sql-lora") and s.scheduler.lora.holders("sql-lora") == {NEW}
        picked = s.scheduler.pick(ScheduleRequest("r", [1, 2, 3], 8), now)
        assert isinstance(picked, Pick) and picked.hosts == (NEW,)

        c.join(s.pool, s.pool.discovered("10.0.0.5", 8200))  # joined twice: the record stays
        assert c.engines[NEW] is record and c._due[NEW].at == now + 30


async def test_a_fingerprint_is_asked_once_per_record_and_the_pools_is_what_its_engines_agree_on() -> None:
    engines = _Engines()
    async with httpx.AsyncClient(transport=httpx.MockTransport(engines)) as http:
        s = _Setup(http)
        s.join()
        c = s.capabilities
        await c.refresh([NEW])
        assert s.catalog.system_fingerprint() == FINGERPRINT and engines.completions == 1
        await c.refresh([NEW])  # a refresh keeps what it knows: no generation
        assert c.engines[NEW].system_fingerprint == FINGERPRINT and engines.completions == 1  # type: ignore[union-attr]

        engines.down.add(NEW)  # restarted with another config: its record fails first ...
        await c.refresh([NEW])
        engines.down.discard(NEW)
        engines.fingerprints[NEW] = "vllm-0.32.0-feedbeef"
        await c.refresh([NEW])  # ... and its next probe asks again
        assert s.catalog.system_fingerprint() == "vllm-0.32.0-feedbeef" and engines.completions == 2

        other = "10.0.0.6:8200"
        s.join(other)
        await c.refresh([other])
        assert s.scheduler.held_out == {} and s.catalog.system_fingerprint() is None  # two configs: none
        s.leave()
        assert s.catalog.system_fingerprint() == FINGERPRINT  # the one left's


async def test_no_engine_is_asked_for_its_fingerprint_when_config_says_not_to() -> None:
    engines = _Engines()
    async with httpx.AsyncClient(transport=httpx.MockTransport(engines)) as http:
        s = _Setup(http, _config(fingerprint=False))
        s.join()
        await s.capabilities.refresh([NEW])
        assert s.scheduler.held_out == {} and engines.completions == 0 and s.catalog.system_fingerprint() is None


async def test_an_engine_that_is_down_when_it_joins_stays_held_out_and_is_retried() -> None:
    engines = _Engines()
    engines.down.add(NEW)
    async with httpx.AsyncClient(transport=httpx.MockTransport(engines)) as http:
        s = _Setup(http)
        s.join()
        await s.capabilities.refresh([NEW])
        assert s.scheduler.held_out == {NEW: "no capability record: unreachable: ConnectError: refused"}
        assert s.capabilities._due[NEW].at == s.clock() + 0.5
        assert not s.capabilities.ready()


async def test_membership_publishes_a_joiner_that_the_background_probe_lets_route() -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(_Engines())) as http:
        s = _Setup(http, _config(health_interval_s=60), clock=time.monotonic)  # real time: a background task
        membership = Membership(s.config, s.scheduler, s.capabilities, lambda pool, instance: [])
        task = asyncio.create_task(s.capabilities.run())
        try:
            await asyncio.sleep(0.05)
            assert s.capabilities.rounds == 0  # nothing to probe yet: it waits (a minute)
            membership.publish(s.pool, frozenset({Found("10.0.0.5", 8200)}))
            assert s.scheduler.held_out == {NEW: NO_RECORD}
            assert await wait_until(lambda: s.scheduler.held_out == {}) < 1.0  # woken, not a minute later
            assert s.capabilities.ready() and membership.snapshot()["union"]["instances"] == {NEW: "routes"}
            membership.publish(s.pool, frozenset())
            assert s.gone() and s.scheduler.instances == []
        finally:
            await asyncio.sleep(0.01)  # (a cancel that comes with a wake-up is lost on 3.11: see the membership tests)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_a_left_engine_keeps_no_record_verdict_listing_or_due_probe() -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(_Engines())) as http:
        s = _Setup(http)
        s.join()
        s.join("10.0.0.6:8200")
        await s.capabilities.refresh()
        assert s.scheduler.held_out == {} and not s.gone()
        s.leave()
        assert s.gone(NEW) is False  # the other engine still lists the adapter
        s.leave("10.0.0.6:8200")
        assert s.gone(NEW) and s.gone("10.0.0.6:8200")
        c = s.capabilities
        c.probe_soon(NEW)  # a breaker or a failed request of a leg still running there
        c.engine_failed(NEW)
        c.breaker_changed(NEW, "open")
        assert NEW not in c._due and NEW not in c._health_due
        await c.refresh()  # a round after the leave: nothing of it comes back
        assert s.gone() and c.snapshot()["engines"] == {}
        assert c.unready() == {"union": "no engine found (a discovered pool with no instance)"}

        s.join()  # back: probed anew from no record
        assert c.engines == {NEW: None} and s.scheduler.held_out == {NEW: NO_RECORD}
        await c.refresh()
        assert s.scheduler.held_out == {} and c.ready()


@pytest.mark.parametrize("down", [False, True], ids=["answers", "fails"])
async def test_a_probe_that_completes_after_the_leave_records_nothing(down: bool) -> None:
    transport = _Held()
    transport.held.add(NEW)
    async with httpx.AsyncClient(transport=httpx.MockTransport(transport)) as http:
        s = _Setup(http)
        s.join()
        probe = asyncio.create_task(s.capabilities.refresh([NEW]))
        await wait_until(lambda: transport.waiting > 0)
        s.leave()
        if down:
            transport.engines.down.add(NEW)
        transport.release.set()
        await probe
        assert s.gone() and s.capabilities.rounds == 1


async def test_a_liveness_check_that_completes_after_the_leave_records_nothing() -> None:
    transport = _Held()
    async with httpx.AsyncClient(transport=httpx.MockTransport(transport)) as http:
        s = _Setup(http)
        s.join()
        await s.capabilities.refresh([NEW])
        transport.held.add(NEW)
        transport.engines.down.add(NEW)  # it fails: a check kept would hold it out and schedule a probe
        check = asyncio.create_task(s.capabilities.check(NEW))
        await wait_until(lambda: transport.waiting > 0)
        s.leave()
        transport.release.set()
        await check
        assert s.gone() and NEW not in s.capabilities._checking
