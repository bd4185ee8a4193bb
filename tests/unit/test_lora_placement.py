"""LoRA adapters across a pool (scheduler/ alone, time passed in): each adapter settles on an
instance and stays within the engines' `max_loras`, a hot one spreads, an instance that does
not list an adapter gets it only when none does, and prefix blocks are per adapter (hashed as
vLLM hashes them)."""

from __future__ import annotations

import random
from collections import deque

import pytest

from scheduler import (
    AdapterPlacement,
    BlockHasher,
    BlockStored,
    KvCacheAffinity,
    LoadBalance,
    Pick,
    Pool,
    PrefixIndex,
    Role,
    RoundRobin,
    Scheduler,
    ScheduleRequest,
    block_hashes,
)
from scheduler.kv_block_hash import Lora
from scheduler.policies import Policy
from tests.vllm_reference import vllm_hashes

ADDRS = ["a:1", "b:2", "c:3"]
BLOCK = 16
PROMPT = [(i * 7919) % 1021 for i in range(8 * BLOCK + 3)]  # 8 full blocks


def _scheduler(
    registered: dict[str, list[str]],
    max_loras: int = 1,
    spread_requests: int = 8,
    policy: Policy | None = None,
    prefix_source: str = "routing",
) -> Scheduler:
    pool = Pool.of("union", Role.UNION, ADDRS, block_size=BLOCK)
    lora = AdapterPlacement(max_loras, spread_requests)
    for address, adapters in registered.items():
        lora.set_registered(address, adapters)
    return Scheduler([pool], policy or LoadBalance(), lora=lora, prefix_source=prefix_source)


def _everywhere(*adapters: str) -> dict[str, list[str]]:
    return {address: list(adapters) for address in ADDRS}


def _pick(
    scheduler: Scheduler, rid: str, adapter: str | None, path: str | None = None, exclude: tuple[str, ...] = ()
) -> Pick:
    pick = scheduler.pick(ScheduleRequest(rid, PROMPT, 16, adapter=adapter, adapter_path=path), 0.0, exclude=exclude)
    assert isinstance(pick, Pick), pick
    return pick


def _send(scheduler: Scheduler, rid: str, adapter: str | None, exclude: tuple[str, ...] = ()) -> str:
    """Pick and commit: the address the request goes to."""
    pick = _pick(scheduler, rid, adapter, exclude=exclude)
    scheduler.commit(pick)
    return pick.instance.address


# -- placement ------------------------------------------------------------------------------


def test_interleaved_adapters_settle_one_per_instance() -> None:
    scheduler = _scheduler(_everywhere("A", "B", "C"), max_loras=1)
    rng = random.Random(7)
    in_flight: dict[str, deque[str]] = {name: deque() for name in "ABC"}
    placed: dict[str, list[str]] = {name: [] for name in "ABC"}
    for n in range(120):
        adapter = rng.choice("ABC")
        placed[adapter].append(_send(scheduler, f"r{n}", adapter))
        in_flight[adapter].append(f"r{n}")
        # requests end out of order with time; under steady traffic an adapter keeps one in flight
        for queue in in_flight.values():
            while len(queue) > 1 and rng.random() < 0.4:
                scheduler.finish(queue.popleft(), 0.0)
    homes = {name: set(addresses) for name, addresses in placed.items()}
    assert all(len(home) == 1 for home in homes.values()), homes  # never a second instance
    assert set.union(*homes.values()) == set(ADDRS)  # and never two adapters on one
    for address in ADDRS:
        assert len(scheduler.lora.running(address)) == 1


def test_a_hot_adapter_spreads_to_an_instance_with_room() -> None:
    scheduler = _scheduler(_everywhere("A"), max_loras=2, spread_requests=2)
    first, second, third, fourth = (_send(scheduler, f"r{n}", "A") for n in range(4))
    assert first == second  # joins the running adapter, though that instance is now the busiest
    assert third != first  # at spread_requests: a free slot elsewhere takes the overflow
    assert fourth == third


def test_a_hot_adapter_stays_put_when_it_would_wait_elsewhere() -> None:
    scheduler = _scheduler(_everywhere("A", "B", "C"), max_loras=1, spread_requests=2)
    home = _send(scheduler, "a0", "A")
    assert len({home, _send(scheduler, "b0", "B"), _send(scheduler, "c0", "C")}) == 3
    assert [_send(scheduler, f"a{n}", "A") for n in range(1, 4)] == [home] * 3


# -- registration -----------------------------------------------------------------------------


def test_an_adapter_goes_only_where_it_is_listed() -> None:
    scheduler = _scheduler({"b:2": ["A"]})
    _send(scheduler, "busy", None, exclude=("a:1", "c:3"))  # b:2 is the busiest instance
    pick = _pick(scheduler, "r1", "A")
    assert pick.hosts == ("b:2",) and not pick.loads_adapter  # no fallback would know it (404)
    scheduler.lora.add_registered("c:3", "A")
    assert set(_pick(scheduler, "r2", "A").hosts) == {"b:2", "c:3"}  # the idle a:1 never


def test_an_adapter_listed_nowhere_is_loaded_where_it_goes() -> None:
    scheduler = _scheduler({"b:2": ["A"]})
    pick = _pick(scheduler, "r1", "Z")
    assert pick.loads_adapter and set(pick.hosts) == set(ADDRS)
    scheduler.commit(pick)
    scheduler.lora.add_registered(pick.instance.address, "Z")  # the caller loaded it there
    again = _pick(scheduler, "r2", "Z")
    assert again.hosts == (pick.instance.address,) and not again.loads_adapter


def test_a_base_model_request_is_routed_as_before() -> None:
    plain = Scheduler([Pool.of("union", Role.UNION, ADDRS, block_size=BLOCK)], RoundRobin())
    scheduler = _scheduler({"a:1": ["A"], "b:2": ["B"]}, policy=RoundRobin())
    picks = [_pick(scheduler, f"r{n}", None) for n in range(4)]
    assert [p.hosts for p in picks] == [_pick(plain, f"r{n}", None).hosts for n in range(4)]
    assert not any(p.loads_adapter for p in picks)
    scheduler.commit(picks[0])
    assert scheduler.lora.running(picks[0].instance.address) == {}  # the base takes no adapter slot


# -- leases ------------------------------------------------------------------------------------


def test_finish_releases_the_running_count() -> None:
    scheduler = _scheduler(_everywhere("A", "B"), max_loras=2)
    home = _send(scheduler, "r0", "A")
    assert [_send(scheduler, f"r{n}", "A") for n in (1, 2)] == [home, home]
    _send(scheduler, "r3", "B", exclude=tuple(a for a in ADDRS if a != home))
    assert scheduler.snapshot()["instances"][home]["adapters"] == {
        "registered": ["A", "B"],
        "running": {"A": 3, "B": 1},
    }
    scheduler.finish("r0", 1.0, served_by=home)
    scheduler.finish("r1", 1.0, failed=[home])
    scheduler.finish("r1", 1.0)  # every exit path may finish: counted once
    scheduler.finish("never-committed", 1.0)
    assert scheduler.lora.running(home) == {"A": 1, "B": 1}
    scheduler.finish("r2", 1.0)
    scheduler.finish("r3", 1.0)
    assert scheduler.snapshot()["instances"][home]["adapters"]["running"] == {}


def test_tiers() -> None:
    lora = AdapterPlacement(max_loras=2, spread_requests=2)
    lora.set_registered("x", ["A", "B", "C"])
    lora.started("1", "x", "A")
    assert (lora.tier("x", "A"), lora.tier("x", "B"), lora.tier("x", "Z")) == (0, 1, 2)
    lora.started("2", "x", "A")
    lora.started("3", "x", "B")
    assert (lora.tier("x", "A"), lora.tier("x", "B"), lora.tier("x", "C")) == (2, 0, 3)
    lora.set_registered("x", ["C"])  # a fresh /v1/models replaces the set
    assert lora.registered("x") == {"C"} and lora.holders("C") == {"x"} and lora.holders("A") == set()


# -- prefix index -------------------------------------------------------------------------------


def test_the_same_tokens_under_two_adapters_and_the_base_hash_apart() -> None:
    index = PrefixIndex(BLOCK)
    base, a, b = index.hashes(PROMPT), index.hashes(PROMPT, "A"), index.hashes(PROMPT, "B")
    assert base == block_hashes(PROMPT, BLOCK)  # the base model's hashes are unchanged
    assert len(base) == len(a) == len(b) == 8
    assert len(set(base) | set(a) | set(b)) == 24
    assert index.hashes(PROMPT, "A", "/loras/a") == a  # routing mode: the name decides


def test_a_prefix_cached_under_one_adapter_does_not_attract_another() -> None:
    scheduler = _scheduler(_everywhere("A", "B"), max_loras=2, policy=KvCacheAffinity())
    home = _send(scheduler, "r0", "A")
    assert _pick(scheduler, "r1", "A").matched_tokens == 8 * BLOCK
    assert _pick(scheduler, "r2", "B").matched_tokens == 0
    assert _pick(scheduler, "r3", None).matched_tokens == 0
    assert _pick(scheduler, "r4", "A").instance.address == home


@pytest.fixture
def _no_hash_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # the engines' default: the fixed seed


@pytest.mark.usefixtures("_no_hash_seed")
def test_kv_events_hashes_under_an_adapter_are_vllms() -> None:
    index = PrefixIndex(BLOCK, hasher=BlockHasher(BLOCK))
    a = index.hashes(PROMPT, "A", "/loras/a")
    assert len(a) == 8 and a == vllm_hashes(BLOCK, PROMPT, lora=Lora("A", "/loras/a"))
    assert index.hashes(PROMPT) == vllm_hashes(BLOCK, PROMPT)
    assert not set(a) & set(index.hashes(PROMPT, "B", "/loras/b"))
    assert index.hashes(PROMPT, "A") == []  # no path: the engine's hash cannot be predicted


@pytest.mark.usefixtures("_no_hash_seed")
def test_an_engines_blocks_for_one_adapter_match_it_and_not_another() -> None:
    scheduler = _scheduler(_everywhere("A", "B"), max_loras=2, policy=KvCacheAffinity(), prefix_source="kv_events")
    for address in ADDRS:
        scheduler.feeds.subscribed(address, live=True)
    scheduler.kv_events("b:2", [BlockStored(tuple(vllm_hashes(BLOCK, PROMPT, lora=Lora("A", "/loras/a"))), BLOCK)])
    for_a = _pick(scheduler, "r1", "A", "/loras/a")
    assert for_a.instance.address == "b:2" and for_a.matched_tokens == 8 * BLOCK
    assert _pick(scheduler, "r2", "B", "/loras/b").matched_tokens == 0
    assert _pick(scheduler, "r3", None).matched_tokens == 0


def test_a_listing_fetched_before_a_load_does_not_unlist_the_loaded_adapter() -> None:
    """A capability probe fetches `/v1/models`, the gateway loads an adapter meanwhile, then
    the probe's listing (without it) arrives: the adapter stays listed there, or the next
    request for it would load it on another instance. A listing fetched after it rules."""
    lora = AdapterPlacement()
    before = lora.mark()
    lora.add_registered("a:1", "sql")
    lora.set_registered("a:1", [], since=before)
    assert lora.holders("sql") == {"a:1"}
    lora.set_registered("a:1", [], since=lora.mark())  # fetched after the load: unloaded since
    assert lora.holders("sql") == set()
    lora.add_registered("a:1", "sql")
    lora.set_registered("a:1", [])  # no mark: the listing rules, as before
    assert lora.holders("sql") == set()
