"""Runtime membership (ext_proc/fleet/membership.py): the flap damper on a clock of the test's
own, publications turned into joins and leaves of a real scheduler, each instance's side work
started and cancelled with it, damped joins, and what `instance_work` runs per instance."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from types import CoroutineType
from typing import Any, cast

import httpx
import pytest

from ext_proc.config import InstanceConfig, PoolConfig, TitoConfig
from ext_proc.fleet import membership as membership_module
from ext_proc.fleet.discovery import Found, Publish
from ext_proc.fleet.membership import FlapDamper, Membership, instance_work
from ext_proc.server import build_scheduler
from scheduler import Capability, Pick, Role, ScheduleRequest
from scheduler.dispatch import NO_RECORD

E1, E2, E3 = Found("10.0.0.1", 8200), Found("10.0.0.2", 8200), Found("10.0.0.3", 8200)


# -- the flap damper ----------------------------------------------------------------------


def test_a_first_join_is_not_held() -> None:
    damper = FlapDamper(window_s=30, hold_s=2, hold_max_s=60)
    assert damper.hold("a:1", 100.0) == 0.0
    assert damper.hold("a:1", 100.0) == 0.0  # never left: never held


def test_each_flap_within_the_window_doubles_the_hold_up_to_its_cap() -> None:
    damper = FlapDamper(window_s=30, hold_s=2, hold_max_s=10)
    holds = []
    now = 0.0
    for _ in range(6):
        damper.left("a:1", now)
        now += 5  # back within the window each time
        holds.append(damper.hold("a:1", now))
    assert holds == [2, 4, 8, 10, 10, 10]
    assert damper.hold("b:2", now) == 0  # per address


def test_the_hold_starts_over_after_a_quiet_window() -> None:
    damper = FlapDamper(window_s=30, hold_s=2, hold_max_s=60)
    damper.left("a:1", 0.0)
    assert damper.hold("a:1", 10.0) == 2
    damper.left("a:1", 20.0)
    assert damper.hold("a:1", 50.0) == 4  # exactly the window: still a flap
    damper.left("a:1", 60.0)
    assert damper.hold("a:1", 90.5) == 0  # away longer than the window
    damper.left("a:1", 100.0)
    assert damper.hold("a:1", 101.0) == 2  # the count started over


# -- membership ---------------------------------------------------------------------------


class _Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class _SideWork:
    """Records each (pool, instance) it is asked to run; each runs until cancelled, and
    says so."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, InstanceConfig]] = []
        self.running: set[str] = set()
        self.cancelled: list[str] = []

    def __call__(self, pool: PoolConfig, instance: InstanceConfig) -> list[Coroutine[Any, Any, None]]:
        self.calls.append((pool.name, instance))
        return [self._forever(instance.address)]

    async def _forever(self, address: str) -> None:
        self.running.add(address)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(address)
            self.running.discard(address)
            raise

    def addresses(self) -> list[str]:
        return [instance.address for _, instance in self.calls]


def _dns_pool(name: str = "union", role: str = "union", **discovery: object) -> dict[str, Any]:
    return {
        "name": name,
        "role": role,
        "discovery": {"source": "dns", "name": f"{name}.engines.test", "port": 8200, **discovery},
    }


def _config(*pools: dict[str, Any]) -> TitoConfig:
    return TitoConfig.model_validate(
        {"render_config": {"enable": False}, "scheduler": {"prefix_source": "routing"}, "pools": list(pools)}
    )


class _Fixture:
    def __init__(self, config: TitoConfig, gated: bool = False) -> None:
        self.config = config
        self.scheduler = build_scheduler(config, gated=gated)
        self.clock = _Clock()
        self.work = _SideWork()
        self.membership = Membership(config, self.scheduler, None, self.work, clock=self.clock)
        self.changes = 0
        self.membership.on_change = self._changed

    def _changed(self) -> None:
        self.changes += 1

    def pool(self, name: str) -> PoolConfig:
        return next(p for p in self.config.pools if p.name == name)

    def publish(self, name: str, *found: Found) -> None:
        self.membership.publish(self.pool(name), frozenset(found))

    def routed(self, role: Role = Role.UNION) -> list[str]:
        return [i.address for i in self.scheduler.pools[role].instances]


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def _stop(task: asyncio.Task[None]) -> None:
    """Cancel a membership loop once it waits again."""
    await _settle()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_publication_joins_the_new_and_leaves_the_gone() -> None:
    f = _Fixture(_config(_dns_pool()))
    assert f.routed() == [] and f.membership.members == {}
    f.publish("union", E1, E2)
    assert f.routed() == [E1.address, E2.address]
    assert f.changes == 2 and f.membership.joins == {"union": 2} and f.membership.leaves == {"union": 0}
    assert sorted(f.membership.addresses()) == [("10.0.0.1", 8200), ("10.0.0.2", 8200)]
    picked = f.scheduler.pick(ScheduleRequest("r", [1, 2, 3], 8), 0.0)
    assert isinstance(picked, Pick) and set(picked.hosts) == {E1.address, E2.address}

    f.publish("union", E1, E2)  # the same membership again: nothing changes
    assert f.changes == 2 and f.work.addresses() == [E1.address, E2.address]

    f.publish("union", E2, E3)
    assert f.routed() == [E2.address, E3.address]
    assert f.changes == 4 and f.membership.joins == {"union": 3} and f.membership.leaves == {"union": 1}
    assert E1.address not in f.scheduler.breakers
    assert sorted(f.membership.addresses()) == [("10.0.0.2", 8200), ("10.0.0.3", 8200)]
    f.publish("union")  # no records: the pool is empty
    assert f.routed() == [] and f.membership.addresses() == [] and f.changes == 6


async def test_side_work_starts_on_join_and_is_cancelled_on_leave() -> None:
    f = _Fixture(_config(_dns_pool()))
    f.publish("union", E1, E2)
    await _settle()
    assert f.work.running == {E1.address, E2.address}
    f.publish("union", E2)
    await _settle()
    assert f.work.cancelled == [E1.address] and f.work.running == {E2.address}


async def test_a_discovered_instance_is_built_from_the_discovery() -> None:
    f = _Fixture(_config(_dns_pool(kv_events_port=5557, capabilities=["decode_colocation"])))
    f.publish("union", Found("10.0.0.7", 8300), Found("[fd00::7]", 8300))
    instances = {instance.address: instance for _, instance in f.work.calls}
    assert [name for name, _ in f.work.calls] == ["union", "union"]
    v4, v6 = instances["10.0.0.7:8300"], instances["[fd00::7]:8300"]
    assert (v4.host, v4.port, v4.capabilities) == ("10.0.0.7", 8300, ["decode_colocation"])
    assert v4.kv_events is not None
    assert (v4.kv_events.endpoint, v4.kv_events.replay_endpoint) == ("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558")
    assert v6.kv_events is not None and v6.kv_events.endpoint == "tcp://[fd00::7]:5557"
    assert f.membership.members["10.0.0.7:8300"][1] == v4
    joined = {i.address: i for i in f.scheduler.instances}
    assert joined["10.0.0.7:8300"].capabilities == frozenset({Capability.COLOCATION})
    assert joined["10.0.0.7:8300"].pool == "union" and joined["10.0.0.7:8300"].role is Role.UNION


async def test_a_discovered_decode_instance_does_handoff_unless_the_discovery_says_otherwise() -> None:
    static_prefill = {"name": "prefill", "role": "prefill", "instances": [{"host": "10.0.9.9", "port": 9000}]}
    for declared, expected in (([], Capability.HANDOFF), (["concurrent_engine_sync"], Capability.TRIGGER)):
        f = _Fixture(_config(static_prefill, _dns_pool("decode", "decode", capabilities=declared)))
        f.publish("decode", E1)
        (instance,) = f.scheduler.pools[Role.DECODE].instances
        assert instance.capabilities == frozenset({expected}) and instance.pool == "decode"


async def test_a_gated_join_waits_for_its_record() -> None:
    f = _Fixture(_config(_dns_pool()), gated=True)
    f.publish("union", E1)
    assert f.scheduler.held_out == {E1.address: NO_RECORD}
    assert f.membership.snapshot()["union"]["instances"] == {E1.address: f"held out: {NO_RECORD}"}
    f.scheduler.set_capabilities(E1.address, None, token_only=True)
    assert f.membership.snapshot()["union"]["instances"] == {E1.address: "routes"}


async def test_an_instance_back_soon_after_leaving_is_damped_longer_each_time() -> None:
    f = _Fixture(_config(_dns_pool(flap_hold_s=2, flap_hold_max_s=8, flap_window_s=30)))
    f.publish("union", E1)
    f.publish("union")  # left at 100
    assert f.changes == 2
    f.clock.now = 101.0
    f.publish("union", E1)  # back within the window: waits 2 s
    assert f.routed() == [] and f.membership.addresses() == [] and f.changes == 2
    assert f.membership.snapshot()["union"]["instances"] == {E1.address: "damped: routes in 2.0 s"}
    assert f.work.addresses() == [E1.address]  # its work waits too
    f.clock.now = 102.5
    assert f.membership.snapshot()["union"]["instances"] == {E1.address: "damped: routes in 0.5 s"}
    f.publish("union", E1)  # still published while it waits: not joined early, not queued twice
    assert f.routed() == [] and f.membership.joins == {"union": 1}

    task = asyncio.create_task(f.membership._join_when_due())
    try:
        await _settle()
        assert f.routed() == []  # not due yet
        f.clock.now = 103.0
        f.membership._wake.set()  # (what a real clock's timeout would do)
        await _settle()
        assert f.routed() == [E1.address] and f.changes == 3 and f.membership.joins == {"union": 2}
        assert f.membership.snapshot()["union"]["instances"] == {E1.address: "routes"}
        assert f.membership.addresses() == [("10.0.0.1", 8200)]
        assert f.work.addresses() == [E1.address, E1.address]

        f.publish("union")  # leaves again at 103, back at 104: 4 s this time
        f.clock.now = 104.0
        f.publish("union", E1)
        assert f.membership.snapshot()["union"]["instances"] == {E1.address: "damped: routes in 4.0 s"}
    finally:
        await _stop(task)


async def test_a_damped_instance_that_leaves_before_it_is_due_never_joins() -> None:
    f = _Fixture(_config(_dns_pool(flap_hold_s=2)))
    f.publish("union", E1)
    f.publish("union")
    f.publish("union", E1)  # damped
    f.publish("union")  # gone again before its due
    assert f.membership.snapshot()["union"]["instances"] == {}
    assert f.changes == 2 and f.membership.leaves == {"union": 1}  # it never routed: no second leave
    f.clock.now = 200.0  # long past its due
    task = asyncio.create_task(f.membership._join_when_due())
    try:
        await _settle()
        assert f.routed() == [] and f.membership.members == {} and f.membership.joins == {"union": 1}
        assert f.work.addresses() == [E1.address]  # its work never started again
    finally:
        await _stop(task)


async def test_a_static_pool_is_there_from_the_start_and_untouched_by_a_dynamic_one() -> None:
    static_prefill = {"name": "prefill", "role": "prefill", "instances": [{"host": "10.0.9.9", "port": 9000}]}
    f = _Fixture(_config(static_prefill, _dns_pool("decode", "decode")))
    static = "10.0.9.9:9000"
    assert list(f.membership.members) == [static] and f.membership.addresses() == [("10.0.9.9", 9000)]
    f.publish("decode", E1)
    f.publish("decode")
    assert list(f.membership.members) == [static] and f.routed(Role.PREFILL) == [static]
    assert f.membership.leaves == {"prefill": 0, "decode": 1}
    snapshot = f.membership.snapshot()
    assert snapshot["prefill"] == {"source": "static", "instances": {static: "routes"}, "joins": 0, "leaves": 0}
    assert snapshot["decode"] == {"source": "dns", "instances": {}, "joins": 1, "leaves": 1}


class _FakeSource:
    """A discovery source that publishes what the test hands it."""

    def __init__(self) -> None:
        self.publish: Publish | None = None
        self.cancelled = False

    async def run(self, publish: Publish) -> None:
        self.publish = publish
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


async def _until(check: Any, timeout: float = 2.0) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, "timed out"
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def test_run_follows_the_sources_joins_when_due_and_stops_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    static_prefill = {"name": "prefill", "role": "prefill", "instances": [{"host": "10.0.9.9", "port": 9000}]}
    config = _config(static_prefill, _dns_pool("decode", "decode", flap_hold_s=0.3, flap_hold_max_s=1))
    source = _FakeSource()
    monkeypatch.setattr(membership_module, "source_for", lambda pool: source if pool.discovery.dynamic else None)
    scheduler = build_scheduler(config)
    work = _SideWork()
    membership = Membership(config, scheduler, None, work)  # the real clock
    task = asyncio.create_task(membership.run())
    try:
        await _until(lambda: source.publish is not None)
        assert work.running == {"10.0.9.9:9000"}  # the static member's work started
        assert source.publish is not None
        source.publish(frozenset({E1}))
        await _until(lambda: E1.address in work.running)
        source.publish(frozenset())
        source.publish(frozenset({E1}))  # a flap: it routes in 0.3 s
        started = time.monotonic()
        await asyncio.sleep(0.1)
        assert [i.address for i in scheduler.pools[Role.DECODE].instances] == []
        await _until(lambda: [i.address for i in scheduler.pools[Role.DECODE].instances] == [E1.address])
        assert time.monotonic() - started >= 0.25
    finally:
        await _stop(task)
    assert source.cancelled
    assert work.running == set() and sorted(work.cancelled) == sorted(["10.0.9.9:9000", E1.address, E1.address])


# -- what each instance runs ----------------------------------------------------------------


async def test_instance_work_subscribes_to_kv_events_only_when_they_feed_the_index() -> None:
    pool = {"discovery": {"source": "dns", "name": "e.test", "kv_events_port": 5557}}
    async with httpx.AsyncClient() as http:
        for prefix_source, kv_events, expected in (
            ("kv_events", True, ["KvEventSubscriber.run"]),
            ("kv_events", False, []),
            ("routing", True, []),
        ):
            config = TitoConfig.model_validate(
                {"render_config": {"enable": False}, "scheduler": {"prefix_source": prefix_source}, "pools": [pool]}
            )
            scheduler = build_scheduler(config)
            pool_config = config.pools[0]
            instance = pool_config.discovered("10.0.0.1", 8200)
            if not kv_events:
                instance = instance.model_copy(update={"kv_events": None})
            work = instance_work(config, scheduler, http)(pool_config, instance)
            try:
                assert [cast("CoroutineType[Any, Any, None]", w).__qualname__ for w in work] == expected
            finally:
                for w in work:
                    w.close()


async def test_instance_work_scrapes_metrics_when_they_are_a_load_source() -> None:
    config = TitoConfig.model_validate(
        {
            "render_config": {"enable": False},
            "scheduler": {"prefix_source": "routing", "load_source": "engine_metrics"},
            "pools": [{"instances": [{"port": 8200}]}],
        }
    )
    async with httpx.AsyncClient() as http:
        work = instance_work(config, build_scheduler(config), http)(config.pools[0], config.pools[0].instances[0])
        try:
            assert [cast("CoroutineType[Any, Any, None]", w).__qualname__ for w in work] == ["EngineMetricsPoller.run"]
        finally:
            for w in work:
                w.close()


@pytest.mark.parametrize("new_first", [True, False], ids=["new pool first", "old pool first"])
async def test_an_engine_moving_between_pools_joins_the_new_once_the_old_lets_it_go(new_first: bool) -> None:
    """A pod relabelled from decode to prefill: both pools publish, in either order."""
    f = _Fixture(_config(_dns_pool("prefill", "prefill"), _dns_pool("decode", "decode")))
    f.publish("decode", E1)
    assert f.routed(Role.DECODE) == [E1.address]
    steps = [("prefill", (E1,)), ("decode", ())]
    for name, found in steps if new_first else steps[::-1]:
        f.publish(name, *found)
    assert f.routed(Role.PREFILL) == [E1.address] and f.routed(Role.DECODE) == []
    assert f.membership.members[E1.address][0].name == "prefill"
    assert f.scheduler.snapshot()["instances"][E1.address]["role"] == "prefill"
