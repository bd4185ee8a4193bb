"""The prefix index fed by the engines' KV cache events (scheduler/ alone, time passed in):
what an engine reports it holds is where a shared prefix goes; removals and a cache reset
are forgotten at once; a lagging stream falls back to routing-time records."""

from __future__ import annotations

from scheduler import (
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    Decision,
    KvCacheAffinity,
    Pool,
    Role,
    Scheduler,
    ScheduleRequest,
)

BLOCK = 16
PROMPT = list(range(1, 8 * BLOCK + 1))  # 8 full blocks
HASHES = tuple(BlockHasher(BLOCK).hashes(PROMPT))


def _scheduler(lag_s: float = 5.0, addresses: tuple[str, ...] = ("a:1", "b:2")) -> Scheduler:
    pool = Pool.of("union", Role.UNION, list(addresses), block_size=BLOCK)
    scheduler = Scheduler([pool], KvCacheAffinity(), prefix_source="kv_events", kv_events_lag_s=lag_s)
    for address in addresses:
        scheduler.feeds.subscribed(address, live=True)
    return scheduler


def _place(scheduler: Scheduler, rid: str, now: float = 0.0) -> Decision:
    decision = scheduler.schedule(ScheduleRequest(rid, PROMPT + [999], 4), now)
    assert isinstance(decision, Decision)
    return decision


def test_a_prefix_goes_where_the_engine_reports_holding_it() -> None:
    scheduler = _scheduler()
    scheduler.kv_events("b:2", [BlockStored(HASHES)])  # b holds it (another gateway's traffic, say)
    decision = _place(scheduler, "r1")
    assert decision.instance.address == "b:2" and decision.matched_tokens == len(HASHES) * BLOCK


def test_routing_alone_records_nothing_for_an_event_fed_instance() -> None:
    scheduler = _scheduler()
    first = _place(scheduler, "r1")
    assert len(scheduler.prefix_index) == 0  # only the engine's own events will say it holds the blocks
    scheduler.kv_events(first.instance.address, [BlockStored(HASHES)])
    scheduler.finish("r1", 1.0, served_by=first.instance.address)
    assert _place(scheduler, "r2", now=1.0).instance == first.instance


def test_removed_blocks_and_a_cache_reset_are_forgotten_within_one_event() -> None:
    scheduler = _scheduler()
    scheduler.kv_events("a:1", [BlockStored(HASHES)])
    scheduler.kv_events("b:2", [BlockStored(HASHES[:2])])
    scheduler.kv_events("a:1", [BlockRemoved(HASHES[4:])])  # evicted: a now holds 4 blocks, b 2
    assert _place(scheduler, "r1").matched_tokens == 4 * BLOCK
    scheduler.kv_events("a:1", [AllBlocksCleared()])
    assert scheduler.prefix_index.match(list(HASHES)) == {"b:2": 2}


def test_a_lagging_stream_falls_back_to_routing_time_records() -> None:
    scheduler = _scheduler(lag_s=5.0, addresses=("a:1",))
    first = _place(scheduler, "r1", now=0.0)  # committed; no event follows
    address = first.instance.address
    assert scheduler.snapshot(now=4.0)["instances"][address]["prefix_source"] == "kv_events"
    assert scheduler.snapshot(now=6.0)["instances"][address]["prefix_source"] == "routing"
    _place(scheduler, "r2", now=6.0)  # recorded at routing time again
    assert len(scheduler.prefix_index) > 0
    scheduler.kv_events(address, [BlockStored(HASHES)])  # the stream is back
    assert scheduler.snapshot(now=7.0)["instances"][address]["prefix_source"] == "kv_events"


def test_an_unsubscribed_instance_is_routing_fed() -> None:
    scheduler = _scheduler()
    scheduler.feeds.subscribed("a:1", live=False)
    assert scheduler.snapshot()["instances"]["a:1"]["prefix_source"] == "routing"
    assert scheduler.snapshot()["instances"]["b:2"]["prefix_source"] == "kv_events"
