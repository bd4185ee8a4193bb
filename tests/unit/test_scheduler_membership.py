"""scheduler/ with pools that change while they serve: `Scheduler.join` and `Scheduler.leave`
(no network, no asyncio, time passed in)."""

from __future__ import annotations

from typing import Any

import pytest

from scheduler import (
    BlockStored,
    BreakerConfig,
    BreakerState,
    Capability,
    Decision,
    EngineLoad,
    Instance,
    KvCacheAffinity,
    Pick,
    Pool,
    Rejection,
    Role,
    RoundRobin,
    Scheduler,
    ScheduleRequest,
)
from scheduler.dispatch import NO_RECORD

A, B, C = "a:1", "b:2", "c:3"
PROMPT = list(range(100, 116))  # 4 full blocks of 4


def _union(addresses: list[str], **kwargs: object) -> Scheduler:
    return Scheduler([Pool.of("union", Role.UNION, addresses, block_size=4)], KvCacheAffinity(), **kwargs)  # type: ignore[arg-type]


def _joined(address: str, role: Role = Role.UNION, pool: str = "union") -> Instance:
    return Instance(address, pool, role)


def _pick(scheduler: Scheduler, rid: str, exclude: tuple[str, ...] = (), role: Role = Role.UNION, **kw: Any) -> Pick:
    picked = scheduler.pick(ScheduleRequest(rid, PROMPT, 8, **kw), 0.0, role, exclude=exclude)
    assert isinstance(picked, Pick), picked
    return picked


def _commit_on(scheduler: Scheduler, rid: str, address: str, **kw: Any) -> Decision:
    """A leg committed on `address` (every other instance excluded)."""
    others = tuple(i.address for i in scheduler.instances if i.address != address)
    pick = _pick(scheduler, rid, exclude=others, **kw)
    assert pick.instance.address == address
    return scheduler.commit(pick)


# -- join -------------------------------------------------------------------------------


def test_an_ungated_join_routes_at_once_with_a_closed_breaker() -> None:
    scheduler = _union([A])
    scheduler.join(_joined(B))
    assert [i.address for i in scheduler.pool.instances] == [A, B]
    assert [i.address for i in scheduler.instances] == [A, B]
    assert _pick(scheduler, "r", exclude=(A,)).instance.address == B
    shown = scheduler.snapshot()["instances"][B]
    assert (shown["routes"], shown["breaker"], shown["prefix_blocks"], shown["active_tokens"]) == (
        True,
        "closed",
        0,
        0,
    )
    assert "held_out" not in shown
    assert scheduler.passthrough_hosts() == (A, B)


def test_a_gated_join_is_held_out_until_its_record_arrives() -> None:
    scheduler = _union([A], gated=True)
    scheduler.set_capabilities(A, None, token_only=True)
    scheduler.join(_joined(B))
    assert scheduler.held_out == {B: NO_RECORD}
    rejected = scheduler.pick(ScheduleRequest("r", PROMPT, 8), 0.0, exclude=(A,))
    assert isinstance(rejected, Rejection) and rejected.status == 503
    assert f"{B}: {NO_RECORD}" in rejected.reason
    for n in range(4):  # only A routes meanwhile
        assert _pick(scheduler, f"r{n}").hosts == (A,)
    shown = scheduler.snapshot()["instances"][B]
    assert (shown["routes"], shown["held_out"]) == (False, NO_RECORD)
    scheduler.set_capabilities(B, None, token_only=True)
    assert _pick(scheduler, "r", exclude=(A,)).instance.address == B


def test_joining_a_known_address_changes_nothing() -> None:
    scheduler = _union([A, B], breaker=BreakerConfig(failure_threshold=1))
    scheduler.breakers[A].record_failure(0.0)  # open: a second join must not reset it
    breaker = scheduler.breakers[A]
    scheduler.join(Instance(A, "union", Role.UNION, frozenset({Capability.COLOCATION})))
    assert [i.address for i in scheduler.pool.instances] == [A, B]
    assert len(scheduler.instances) == 2
    assert scheduler.breakers[A] is breaker and breaker.state is BreakerState.OPEN
    assert scheduler.pool.instances[0].capabilities == frozenset()


def test_a_known_address_does_not_join_another_pool_either() -> None:
    scheduler = Scheduler(
        [Pool.of("prefill", Role.PREFILL, [A], block_size=4), Pool.of("decode", Role.DECODE, [B], block_size=4)],
        KvCacheAffinity(),
    )
    scheduler.join(_joined(A, Role.DECODE, "decode"))
    assert [i.address for i in scheduler.pools[Role.DECODE].instances] == [B]
    assert [i.address for i in scheduler.instances] == [A, B]


def test_a_role_without_a_pool_takes_no_instance() -> None:
    scheduler = _union([A], gated=True)
    scheduler.join(_joined(B, Role.DECODE, "decode"))
    assert set(scheduler.pools) == {Role.UNION}
    assert B not in scheduler.breakers and B not in scheduler.held_out
    assert [i.address for i in scheduler.instances] == [A]
    assert B not in scheduler.snapshot()["instances"]


def test_a_pool_may_start_empty_and_fill_as_instances_join() -> None:
    scheduler = Scheduler([Pool("union", Role.UNION, (), block_size=4)], KvCacheAffinity())
    rejected = scheduler.pick(ScheduleRequest("r", PROMPT, 8), 0.0)
    assert rejected == Rejection(503, "no union engine instance")
    assert scheduler.passthrough_hosts() == ()
    assert scheduler.snapshot()["instances"] == {}
    scheduler.join(_joined(A))
    assert _pick(scheduler, "r").hosts == (A,)


def test_a_joined_decode_instance_keeps_its_capabilities() -> None:
    scheduler = Scheduler(
        [Pool.of("prefill", Role.PREFILL, [A], block_size=4), Pool("decode", Role.DECODE, (), block_size=4)],
        KvCacheAffinity(),
    )
    scheduler.join(Instance(B, "decode", Role.DECODE, frozenset({Capability.TRIGGER})))
    assert scheduler.pick(ScheduleRequest("r", PROMPT, 8), 0.0, Role.DECODE, needs=Capability.HANDOFF) == Rejection(
        503, "no decode engine instance with prefill_handoff_decode"
    )
    picked = scheduler.pick(ScheduleRequest("r", PROMPT, 8), 0.0, Role.DECODE, needs=Capability.TRIGGER)
    assert isinstance(picked, Pick) and picked.instance.address == B


# -- leave ------------------------------------------------------------------------------


def test_a_left_instance_is_never_picked_nor_a_fallback() -> None:
    scheduler = Scheduler([Pool.of("union", Role.UNION, [A, B, C], block_size=4)], RoundRobin(), max_fallbacks=2)
    assert set(_pick(scheduler, "before").hosts) == {A, B, C}
    scheduler.leave(B)
    hosts = [_pick(scheduler, f"r{n}").hosts for n in range(6)]
    assert all(B not in h for h in hosts) and {h[0] for h in hosts} == {A, C}
    assert all(len(h) == 2 for h in hosts)  # the other one still falls back
    assert scheduler.pick(ScheduleRequest("x", PROMPT, 8), 0.0, exclude=(A, C)) == Rejection(
        503, "no union engine instance left to try"
    )
    assert B not in scheduler.passthrough_hosts()
    assert [i.address for i in scheduler.pool.instances] == [A, C]


def test_leaving_drops_every_per_instance_state() -> None:
    scheduler = _union([A, B], gated=True)
    for address in (A, B):
        scheduler.set_capabilities(address, None, token_only=True)
    index = scheduler.prefix_index
    scheduler.feeds.subscribed(B, True)
    scheduler.ignore_kv_events(B, True)  # its events are hashed unlike the index: routing records
    decision = _commit_on(scheduler, "r", B)  # records its 4 blocks
    scheduler.finish(decision.request_id, 0.0, served_by=B)
    scheduler.set_capabilities(B, "tokenizer mismatch", token_only=False, max_model_len=1000)
    scheduler.engine_load(B, EngineLoad(running=3, waiting=1, kv_usage=0.5, kv_capacity_tokens=1000, at=0.0))
    scheduler.lora.set_registered(B, ["sql"])
    scheduler.lora.add_registered(B, "chat")
    # all there before the leave (so that what follows can fail)
    assert index.held(B) == 4 and scheduler.snapshot()["prefix_index_blocks"] == 4
    assert scheduler.held_out == {B: "tokenizer mismatch"} and scheduler.max_model_lens == {B: 1000}
    assert not scheduler.supports_token_only(B) and scheduler.events_ignored == {B}
    assert scheduler.engine_loads.describe(B, 0.0) is not None and scheduler.lora.holders("sql") == {B}

    scheduler.leave(B)
    assert B not in scheduler.breakers and B not in scheduler.held_out and B not in scheduler.max_model_lens
    assert B not in scheduler.token_only_unsupported and B not in scheduler.events_ignored
    assert scheduler.engine_loads.describe(B, 0.0) is None and scheduler.engine_loads.fresh(B, 0.0) is None
    assert not scheduler.feeds.event_fed(B, 0.0)
    assert scheduler.lora.registered(B) == frozenset() and scheduler.lora.holders("sql") == set()
    assert scheduler.lora.holders("chat") == set()
    assert index.held(B) == 0 and len(index) == 0 and index.match(index.hashes(PROMPT)) == {}
    snapshot = scheduler.snapshot()
    assert list(snapshot["instances"]) == [A] and snapshot["prefix_index_blocks"] == 0
    assert scheduler.held_out == {} and scheduler.max_model_lens == {}


def test_leaving_keeps_blocks_another_instance_holds() -> None:
    scheduler = _union([A, B])
    index = scheduler.prefix_index
    index.record(index.hashes(PROMPT), A)
    index.record(index.hashes(PROMPT), B)
    scheduler.leave(B)
    assert index.held(A) == 4 and len(index) == 4
    assert index.match(index.hashes(PROMPT)) == {A: 4}


def test_kv_events_of_a_left_instance_record_nothing() -> None:
    scheduler = _union([A, B], prefix_source="kv_events")
    hashes = (11, 12, 13)
    scheduler.kv_events(B, [BlockStored(hashes)])
    assert scheduler.prefix_index.held(B) == 3
    scheduler.leave(B)
    scheduler.kv_events(B, [BlockStored(hashes)])  # a late batch from its subscription
    assert scheduler.prefix_index.held(B) == 0 and len(scheduler.prefix_index) == 0


def test_leaving_an_unknown_address_changes_nothing() -> None:
    scheduler = _union([A, B])
    scheduler.leave("z:9")
    assert [i.address for i in scheduler.instances] == [A, B] and set(scheduler.breakers) == {A, B}


def test_a_decode_instance_leaves_its_pool() -> None:
    scheduler = Scheduler(
        [Pool.of("prefill", Role.PREFILL, [A], block_size=4), Pool.of("decode", Role.DECODE, [B, C], block_size=4)],
        KvCacheAffinity(),
    )
    scheduler.leave(B)
    assert [i.address for i in scheduler.pools[Role.DECODE].instances] == [C]
    for n in range(3):
        assert _pick(scheduler, f"r{n}", role=Role.DECODE).hosts == (C,)
    assert scheduler.passthrough_hosts() == (C,)  # the decode pool serves the passthrough


@pytest.mark.parametrize(
    "outcome",
    [
        {"failed": [B]},
        {"served_by": B},
        {},  # no engine verdict (the client left first)
        {"failed": [B, A]},  # the other instance's failure still counts
    ],
)
def test_a_leg_committed_before_the_leave_finishes_and_gives_back_its_tokens(outcome: dict[str, object]) -> None:
    scheduler = _union([A, B])
    decision = _commit_on(scheduler, "r", B, adapter="sql")
    demand = len(PROMPT) + 8
    assert scheduler.ledger.total_tokens == demand and scheduler.lora.running(B) == {"sql": 1}
    scheduler.leave(B)
    # still running there: its lease is kept until the leg finishes
    assert scheduler.ledger.active_tokens(B) == demand and scheduler.ledger.active_requests(B) == 1
    scheduler.finish(decision.request_id, 1.0, **outcome)  # type: ignore[arg-type]
    ledger = scheduler.ledger
    assert (ledger.total_tokens, ledger.active_leases, ledger.active_tokens(B), ledger.active_requests(B)) == (
        0,
        0,
        0,
        0,
    )
    assert scheduler.lora.running(B) == {}
    assert B not in scheduler.breakers  # a verdict on a left instance does not bring a breaker back
    assert scheduler.breakers[A].failures == (1 if A in outcome.get("failed", []) else 0)  # type: ignore[operator]
    assert list(scheduler.snapshot()["instances"]) == [A]


def test_a_rejoin_starts_with_a_closed_breaker_and_no_blocks() -> None:
    scheduler = _union([A, B], breaker=BreakerConfig(failure_threshold=2))
    decision = _commit_on(scheduler, "r", B)
    scheduler.finish(decision.request_id, 0.0, failed=[B])
    scheduler.breakers[B].record_failure(0.0)
    assert scheduler.breakers[B].state is BreakerState.OPEN and scheduler.prefix_index.held(B) == 4
    assert scheduler.pick(ScheduleRequest("x", PROMPT, 8), 0.0, exclude=(A,)) == Rejection(
        503, "no healthy union engine instance (all circuit breakers open)"
    )
    scheduler.leave(B)
    scheduler.join(_joined(B))
    breaker = scheduler.breakers[B]
    assert (breaker.state, breaker.failures) == (BreakerState.CLOSED, 0)
    assert scheduler.prefix_index.held(B) == 0
    picked = _pick(scheduler, "again", exclude=(A,))
    assert picked.instance.address == B and picked.matched_tokens == 0
    shown = scheduler.snapshot()["instances"][B]
    assert (shown["breaker"], shown["consecutive_failures"], shown["prefix_blocks"]) == ("closed", 0, 0)
