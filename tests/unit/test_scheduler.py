"""scheduler/ alone: no network, no asyncio, time passed in."""

from __future__ import annotations

import pytest

from scheduler import (
    AffinityWeights,
    BreakerConfig,
    BreakerState,
    CircuitBreaker,
    ContextOverflow,
    Decision,
    KvCacheAffinity,
    LoadBalance,
    Pick,
    Pool,
    PrefixIndex,
    Rejection,
    Role,
    RoundRobin,
    Scheduler,
    ScheduleRequest,
    TokenLedger,
    block_hashes,
    clamp_max_tokens,
    make_policy,
)

ADDRS = ["a:1", "b:2", "c:3"]


def _pool(addresses: list[str] = ADDRS) -> Pool:
    return Pool.of("union", Role.UNION, addresses)


def _decide(scheduler: Scheduler, rid: str, ids: list[int], max_tokens: int = 16, now: float = 0.0) -> Decision:
    outcome = scheduler.schedule(ScheduleRequest(rid, ids, max_tokens), now)
    assert isinstance(outcome, Decision), outcome
    return outcome


# -- policies ---------------------------------------------------------------------------


def test_round_robin_cycles_and_lists_the_others_as_fallbacks() -> None:
    scheduler = Scheduler([_pool()], RoundRobin())
    decisions = [_decide(scheduler, f"r{n}", [1, 2]) for n in range(4)]
    assert [d.instance.address for d in decisions] == ["a:1", "b:2", "c:3", "a:1"]
    assert decisions[0].hosts == ("a:1", "b:2", "c:3")
    assert decisions[1].hosts == ("b:2", "c:3", "a:1")


def test_load_balance_picks_least_active_tokens() -> None:
    scheduler = Scheduler([_pool()], LoadBalance())
    first = _decide(scheduler, "big", list(range(100)), max_tokens=100)
    second = _decide(scheduler, "small", [1], max_tokens=1)
    third = _decide(scheduler, "next", [1], max_tokens=1)
    assert len({first.instance, second.instance, third.instance}) == 3
    scheduler.finish("small", 1.0)
    scheduler.finish("next", 1.0)
    # a:1 still holds 200 tokens: the next requests avoid it
    assert _decide(scheduler, "x", [1], 1).instance.address != first.instance.address


def test_load_balance_spread_stays_within_one_request() -> None:
    scheduler = Scheduler([_pool()], LoadBalance())
    for n in range(30):
        _decide(scheduler, f"r{n}", list(range(50)), max_tokens=50)
    loads = [scheduler.ledger.active_tokens(a) for a in ADDRS]
    assert max(loads) - min(loads) <= 100


def test_affinity_follows_the_cached_prefix() -> None:
    scheduler = Scheduler([_pool()], KvCacheAffinity(), prefix_index=PrefixIndex(block_size=4))
    system = list(range(100, 164))  # 16 full blocks
    home = _decide(scheduler, "r0", system + [1, 2]).instance
    scheduler.finish("r0", 0.0, served_by=home.address)
    for n in range(5):
        decision = _decide(scheduler, f"r{n + 1}", system + [n, n + 1, n + 2])
        assert decision.instance == home and decision.matched_tokens == 64
        scheduler.finish(decision.request_id, 0.0, served_by=home.address)
    busy = _decide(scheduler, "busy", system + [7], max_tokens=1)  # home holds load now
    decision = _decide(scheduler, "other", list(range(500, 564)))
    assert decision.instance != busy.instance  # no hit: the least loaded, not the busy home
    assert decision.matched_tokens == 0


def test_affinity_below_hit_threshold_is_load_balance() -> None:
    policy = KvCacheAffinity(AffinityWeights(hit_rate_threshold=0.9))
    scheduler = Scheduler([_pool()], policy, prefix_index=PrefixIndex(block_size=4))
    prompt = list(range(40))
    home = _decide(scheduler, "r0", prompt).instance
    # Half the prompt cached: 0.5 <= 0.9 -> load balance, which avoids the busy home.
    assert _decide(scheduler, "r1", prompt[:20] + list(range(900, 920))).instance != home


def test_affinity_trades_cache_hits_against_load() -> None:
    policy = KvCacheAffinity(AffinityWeights(load_weight=1.0))
    scheduler = Scheduler([_pool(["a:1", "b:2"])], policy, prefix_index=PrefixIndex(block_size=4))
    prompt = list(range(16))
    home = _decide(scheduler, "r0", prompt, max_tokens=10_000).instance  # home now very busy
    assert _decide(scheduler, "r1", prompt, max_tokens=1).instance != home


def test_make_policy() -> None:
    assert isinstance(make_policy("load_balance"), LoadBalance)
    assert isinstance(make_policy("kv_cache_affinity"), KvCacheAffinity)
    with pytest.raises(ValueError):
        make_policy("magic")


def test_a_union_pool_is_required() -> None:
    with pytest.raises(ValueError):
        Scheduler([Pool.of("p", Role.PREFILL, ["a:1"])], RoundRobin())


# -- prefix index -----------------------------------------------------------------------


def test_only_full_blocks_are_hashed_and_hashes_chain() -> None:
    assert block_hashes([1, 2, 3], 4) == []
    assert len(block_hashes(list(range(11)), 4)) == 2
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # the same block after another prefix is another prefix


def test_prefix_hit_partial_hit_and_miss() -> None:
    index = PrefixIndex(block_size=4)
    prompt = list(range(16))
    index.record(index.hashes(prompt), "a:1")
    index.record(index.hashes(prompt[:8]), "b:2")
    assert index.match(index.hashes(prompt)) == {"a:1": 4, "b:2": 2}
    assert index.match(index.hashes(prompt[:8] + [99] * 8)) == {"a:1": 2, "b:2": 2}
    assert index.match(index.hashes([99] * 16)) == {}
    assert index.match(index.hashes(prompt[:3])) == {}  # shorter than a block


def test_prefix_index_is_bounded_lru() -> None:
    index = PrefixIndex(block_size=2, max_blocks=4)
    old, new = [1, 1, 2, 2], [3, 3, 4, 4, 5, 5]
    index.record(index.hashes(old), "a:1")
    index.record(index.hashes(new), "b:2")
    assert len(index) == 4
    assert index.match(index.hashes(old)) == {}  # first block evicted: no prefix left
    assert index.match(index.hashes(new)) == {"b:2": 3}


# -- admission ledger -------------------------------------------------------------------


def test_ledger_admits_rejects_and_releases() -> None:
    ledger = TokenLedger(global_budget=100, instance_budget=60)
    assert ledger.instance_room("a:1", 60) and not ledger.instance_room("a:1", 61)
    ledger.acquire("r1", "a:1", 50)
    assert not ledger.instance_room("a:1", 20) and ledger.instance_room("b:2", 50)
    ledger.acquire("r2", "b:2", 50)
    assert not ledger.global_room(1)
    assert ledger.release("r1") is not None
    assert ledger.release("r1") is None  # idempotent
    assert ledger.total_tokens == 50 and ledger.active_tokens("a:1") == 0
    ledger.release("r2")
    assert ledger.total_tokens == 0 and ledger.active_leases == 0


def test_scheduler_rejects_over_budget_with_429_and_frees_on_finish() -> None:
    scheduler = Scheduler([_pool(["a:1", "b:2"])], LoadBalance(), ledger=TokenLedger(instance_budget=100))
    _decide(scheduler, "r1", [1] * 50, max_tokens=50)
    _decide(scheduler, "r2", [1] * 50, max_tokens=50)
    rejected = scheduler.schedule(ScheduleRequest("r3", [1] * 10, 10), 0.0)
    assert isinstance(rejected, Rejection) and rejected.status == 429
    scheduler.finish("r1", 1.0)
    assert _decide(scheduler, "r3", [1] * 10, 10).instance.address == "a:1"
    for rid in ("r2", "r3"):
        scheduler.finish(rid, 1.0)
    assert scheduler.snapshot()["total_active_tokens"] == 0


def test_admission_charges_every_choice_and_every_prompt_of_a_batch() -> None:
    assert ScheduleRequest("r", [1] * 10, 7).demand == 17
    assert ScheduleRequest("r", [1] * 10, 7, n=3).demand == 10 + 21
    # the rest of a two-prompt batch: a 4-token prompt with n=3 × 7
    assert ScheduleRequest("r", [1] * 10, 7, n=3, other_prompts_demand=4 + 21).demand == 56
    scheduler = Scheduler([_pool(["a:1"])], LoadBalance(), ledger=TokenLedger(global_budget=40))
    rejected = scheduler.schedule(ScheduleRequest("r1", [1] * 10, 7, n=5), 0.0)
    assert isinstance(rejected, Rejection) and rejected.status == 429


# -- circuit breaker --------------------------------------------------------------------


def test_breaker_opens_cools_down_probes_and_closes() -> None:
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=2, base_cooldown_s=5, max_cooldown_s=15))
    breaker.record_failure(0.0)
    assert breaker.allows(0.0)
    breaker.record_failure(1.0)
    assert breaker.state is BreakerState.OPEN and not breaker.allows(5.9)
    assert breaker.allows(6.0) and breaker.state is BreakerState.HALF_OPEN
    breaker.on_dispatch()
    assert not breaker.allows(6.1)  # one probe at a time
    breaker.record_failure(7.0)  # probe failed: reopen, cool-down doubled
    assert breaker.state is BreakerState.OPEN and breaker.cooldown_s == 10
    assert not breaker.allows(16.9) and breaker.allows(17.0)
    breaker.on_dispatch()
    breaker.record_failure(17.5)
    assert breaker.cooldown_s == 15  # capped
    assert breaker.allows(32.5)
    breaker.on_dispatch()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.failures == 0 and breaker.cooldown_s == 5


def test_abandoned_probe_allows_another() -> None:
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=1, base_cooldown_s=1))
    breaker.record_failure(0.0)
    assert breaker.allows(1.0)
    breaker.on_dispatch()
    breaker.record_abandoned()
    assert breaker.allows(1.1)


def test_success_resets_consecutive_failures() -> None:
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=2))
    breaker.record_failure(0.0)
    breaker.record_success()
    breaker.record_failure(0.0)
    assert breaker.state is BreakerState.CLOSED


def test_scheduler_routes_around_open_breakers_and_probes_later() -> None:
    config = BreakerConfig(failure_threshold=1, base_cooldown_s=10)
    scheduler = Scheduler([_pool(["a:1", "b:2"])], RoundRobin(), breaker=config)
    first = _decide(scheduler, "r1", [1])
    assert first.hosts == ("a:1", "b:2")
    scheduler.finish("r1", 0.0, failed=["a:1"], served_by="b:2")  # Envoy retried on b
    for n in range(3):
        decision = _decide(scheduler, f"x{n}", [1], now=1.0)
        assert decision.hosts == ("b:2",)
        scheduler.finish(decision.request_id, 1.0, served_by="b:2")
    probes = [_decide(scheduler, f"p{n}", [1], now=11.0) for n in range(2)]
    assert "a:1" in probes[0].hosts + probes[1].hosts
    assert snapshot_breaker(scheduler, "a:1") == "half_open"
    scheduler.finish("p0", 11.0, served_by=probes[0].instance.address)
    scheduler.finish("p1", 11.0, served_by=probes[1].instance.address)
    assert snapshot_breaker(scheduler, "a:1") == "closed"


def test_all_breakers_open_is_503_and_routes_when_panic_is_asked() -> None:
    """Every breaker open: refused, unless the caller asks for Envoy's panic routing (its last
    resort); then picked as if none were open, the Pick says so, and a success closes it."""
    scheduler = Scheduler([_pool(["a:1", "b:2"])], RoundRobin(), breaker=BreakerConfig(failure_threshold=1))
    for address in ("a:1", "b:2"):
        decision = _decide(scheduler, f"f-{address}", [1])
        scheduler.finish(decision.request_id, 0.0, failed=[address])
    assert {snapshot_breaker(scheduler, a) for a in ("a:1", "b:2")} == {"open"}
    refused = scheduler.schedule(ScheduleRequest("r1", [1], 1), 0.5)
    assert refused == Rejection(503, "no healthy union engine instance (all circuit breakers open)")
    picked = scheduler.pick(ScheduleRequest("r2", [1], 1), 0.5, panic=True)
    assert isinstance(picked, Pick) and picked.panic and len(picked.hosts) == 2
    decision = scheduler.commit(picked)
    scheduler.finish(decision.request_id, 0.6, served_by=picked.instance.address)
    assert snapshot_breaker(scheduler, picked.instance.address) == "closed"
    calm = scheduler.pick(ScheduleRequest("r3", [1], 1), 0.7, panic=True)
    assert isinstance(calm, Pick) and not calm.panic and calm.hosts == (picked.instance.address,)


def test_passthrough_takes_no_lease_no_probe_and_avoids_open_breakers() -> None:
    config = BreakerConfig(failure_threshold=1, base_cooldown_s=10)
    scheduler = Scheduler([_pool(["a:1", "b:2"])], RoundRobin(), breaker=config)
    _decide(scheduler, "r1", [1])
    scheduler.finish("r1", 0.0, failed=["a:1"])
    assert scheduler.passthrough_hosts() == ("b:2",)
    assert scheduler.ledger.active_leases == 0
    # after the cool-down the probe is still there for inference to take
    assert scheduler.passthrough_hosts() == ("b:2",)
    probe = _decide(scheduler, "p", [1], now=11.0)
    assert "a:1" in probe.hosts and snapshot_breaker(scheduler, "a:1") == "half_open"


def snapshot_breaker(scheduler: Scheduler, address: str) -> str:
    return str(scheduler.snapshot()["instances"][address]["breaker"])


# -- context budget ---------------------------------------------------------------------


def test_context_budget_clamps_and_rejects() -> None:
    assert clamp_max_tokens(prompt_tokens=20, max_tokens=100, max_model_len=64) == 44
    assert clamp_max_tokens(prompt_tokens=20, max_tokens=10, max_model_len=64) == 10
    with pytest.raises(ContextOverflow):
        clamp_max_tokens(prompt_tokens=64, max_tokens=1, max_model_len=64)
