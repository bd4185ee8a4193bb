"""Load from the engines: the pure combination with the ledger (scheduler/engine_load.py), the
scheduler ranking on it, and the /metrics reader and poller (no network: in-process transports)."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest

from ext_proc.config import PoolConfig, TitoConfig
from ext_proc.config_routing import SchedulerConfig
from ext_proc.fleet.engine_metrics import (
    EngineMetricsPoller,
    MetricsUnreadable,
    parse_engine_metrics,
)
from ext_proc.fleet.membership import instance_work
from scheduler import (
    Decision,
    EngineLoad,
    EngineLoads,
    KvCacheAffinity,
    LoadBalance,
    Pick,
    Pool,
    Role,
    Scheduler,
    ScheduleRequest,
    block_hashes,
)
from tests.engine_sim import EngineSim

A, B = "a:1", "b:2"
CAPACITY = 16_000
HEAVY = EngineLoad(running=40, waiting=10, kv_usage=0.9, kv_capacity_tokens=CAPACITY, at=0.0)
IDLE = EngineLoad(running=0, waiting=0, kv_usage=0.0, kv_capacity_tokens=CAPACITY, at=0.0)


# -- the combination ----------------------------------------------------------------------


def test_without_a_sample_the_ledger_alone() -> None:
    assert EngineLoads(5.0).active(A, 0.0, 300, 2) == (300, 2)


def test_a_fresh_sample_counts_what_the_engine_reports_beyond_the_ledger() -> None:
    loads = EngineLoads(5.0)
    loads.sampled(A, HEAVY)
    assert loads.active(A, 4.9, 300, 2) == (round(0.9 * CAPACITY), 50)


def test_the_ledger_wins_where_it_is_larger() -> None:
    loads = EngineLoads(5.0)
    loads.sampled(A, EngineLoad(running=1, waiting=0, kv_usage=0.01, kv_capacity_tokens=CAPACITY, at=0.0))
    assert loads.active(A, 1.0, 5_000, 7) == (5_000, 7)


def test_a_stale_sample_is_ignored() -> None:
    loads = EngineLoads(5.0)
    loads.sampled(A, HEAVY)
    assert loads.fresh(A, 4.99) == HEAVY
    assert loads.active(A, 5.0, 300, 2) == (300, 2)
    assert loads.fresh(A, 5.0) is None


def test_commits_since_the_sample_are_added_until_the_next_one() -> None:
    loads = EngineLoads(5.0)
    loads.committed(A, 1_000)  # before the sample: the engine counts it already
    loads.sampled(A, IDLE)
    loads.committed(A, 100)
    loads.committed(A, 50)
    loads.committed(B, 7)  # another instance's
    assert loads.active(A, 1.0, 0, 0) == (150, 2)  # finished since, still counted: errs high
    loads.sampled(A, EngineLoad(running=1, waiting=0, kv_usage=0.0, kv_capacity_tokens=CAPACITY, at=1.0))
    assert loads.active(A, 1.5, 0, 0) == (0, 1)


def test_unknown_capacity_leaves_the_tokens_to_the_ledger() -> None:
    loads = EngineLoads(5.0)
    loads.sampled(A, EngineLoad(running=3, waiting=2, kv_usage=0.9, kv_capacity_tokens=None, at=0.0))
    loads.committed(A, 100)
    assert loads.active(A, 1.0, 40, 1) == (40, 6)


# -- the scheduler ------------------------------------------------------------------------


def _scheduler(policy: LoadBalance | KvCacheAffinity, load_source: str = "engine_metrics") -> Scheduler:
    return Scheduler([Pool.of("union", Role.UNION, [A, B])], policy, load_source=load_source)


def _pick(scheduler: Scheduler, now: float = 1.0, rid: str = "r") -> str:
    picked = scheduler.pick(ScheduleRequest(rid, list(range(1, 65)), 16), now)
    assert isinstance(picked, Pick), picked
    return picked.instance.address


def test_load_balance_avoids_the_engine_that_reports_more_load() -> None:
    scheduler = _scheduler(LoadBalance())
    scheduler.engine_load(A, HEAVY)
    scheduler.engine_load(B, IDLE)
    assert [_pick(scheduler) for _ in range(4)] == [B] * 4  # the ledgers are equal (empty)


def test_affinity_weighs_engine_load_against_equal_cache_hits() -> None:
    scheduler = _scheduler(KvCacheAffinity())
    hashes = block_hashes(list(range(1, 65)), scheduler.prefix_index.block_size)
    scheduler.prefix_index.record(hashes, A)
    scheduler.prefix_index.record(hashes, B)
    scheduler.engine_load(A, HEAVY)
    scheduler.engine_load(B, IDLE)
    assert _pick(scheduler) == B  # on the ledger alone: a tie, and A by position


def test_with_load_source_ledger_the_samples_are_ignored() -> None:
    scheduler = _scheduler(LoadBalance(), load_source="ledger")
    scheduler.engine_load(A, HEAVY)
    scheduler.engine_load(B, IDLE)
    assert [_pick(scheduler) for _ in range(4)] == [A, B, A, B]
    instances = scheduler.snapshot(1.0)["instances"]
    assert instances[A]["load_source"] == "ledger"
    assert instances[A]["engine"] == {"running": 40, "waiting": 10, "kv_usage": 0.9, "age_s": 1.0}


def test_commits_since_the_sample_move_ranking_and_a_new_sample_resets_them() -> None:
    scheduler = _scheduler(LoadBalance())
    scheduler.engine_load(A, IDLE)
    scheduler.engine_load(B, IDLE)
    first = scheduler.schedule(ScheduleRequest("r1", [1, 2], 8), 1.0)
    assert isinstance(first, Decision) and first.instance.address == A
    scheduler.finish("r1", 1.0)  # the ledger forgets it; the engine has not reported it yet
    assert [_pick(scheduler) for _ in range(2)] == [B, B]
    scheduler.engine_load(A, EngineLoad(0, 0, 0.0, CAPACITY, at=1.0))  # A reports it done
    assert {_pick(scheduler) for _ in range(2)} == {A, B}  # equal again: they take turns


def test_a_stale_sample_falls_back_to_the_ledger_and_the_snapshot_says_so() -> None:
    scheduler = _scheduler(LoadBalance())
    scheduler.engine_load(A, HEAVY)
    scheduler.engine_load("elsewhere:9", HEAVY)  # not an instance: dropped
    instances = scheduler.snapshot(1.0)["instances"]
    assert instances[A]["load_source"] == "engine_metrics" and instances[B]["load_source"] == "ledger"
    assert "engine" not in instances[B] and "elsewhere:9" not in instances
    assert scheduler.snapshot(5.0)["instances"][A]["load_source"] == "ledger"
    assert _pick(scheduler, now=5.0) == A  # stale: equal ledgers, A by position
    scheduler.engine_load(A, EngineLoad(40, 10, 0.9, CAPACITY, at=5.0))
    assert [_pick(scheduler, now=6.0) for _ in range(2)] == [B, B]


def test_admission_stays_on_the_ledger() -> None:
    scheduler = _scheduler(LoadBalance())
    scheduler.engine_load(A, HEAVY)
    scheduler.schedule(ScheduleRequest("r1", [1, 2], 8), 1.0)
    assert scheduler.ledger.active_tokens(B) == 10 and scheduler.ledger.active_tokens(A) == 0


def test_an_unknown_load_source_is_refused() -> None:
    with pytest.raises(ValueError, match="load_source"):
        _scheduler(LoadBalance(), load_source="gossip")


# -- reading /metrics ---------------------------------------------------------------------

TWO_CORES = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.25
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100",note="a, b} c"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="300",num_gpu_blocks_override="None"} 1.0
vllm:num_requests_running_total 99.0
"""


def test_two_engine_cores_are_summed_and_their_usage_weighted_by_size() -> None:
    load = parse_engine_metrics(TWO_CORES, at=7.0)
    # usage: (0.5 × 1600 + 0.25 × 4800) / 6400; waiting_by_reason is not waiting again
    assert load == EngineLoad(running=4, waiting=2, kv_usage=0.3125, kv_capacity_tokens=6400, at=7.0)


def test_a_cache_not_sized_yet_leaves_the_capacity_unknown() -> None:
    text = TWO_CORES.replace('num_gpu_blocks="300"', 'num_gpu_blocks="None"')
    load = parse_engine_metrics(text, at=0.0)
    assert (load.kv_usage, load.kv_capacity_tokens) == (0.375, None)


@pytest.mark.parametrize(
    "text",
    ["", "<html>not metrics</html>", TWO_CORES.replace("vllm:kv_cache_usage_perc", "x")],
    ids=["empty", "html", "no-kv-usage"],
)
def test_unreadable_metrics_raise(text: str) -> None:
    with pytest.raises(MetricsUnreadable):
        parse_engine_metrics(text, at=0.0)
    with pytest.raises(ValueError):  # what the poller catches, bad values included
        parse_engine_metrics(TWO_CORES.replace("3.0", "three"), at=0.0)


async def test_the_simulators_metrics_read_as_its_load() -> None:
    sim = EngineSim()
    sim.external_load = (5, 2, 0.4)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=sim.app())) as http:
        text = (await http.get("http://sim/metrics")).text
    assert parse_engine_metrics(text, at=0.0) == EngineLoad(5, 2, 0.4, sim.kv_blocks * sim.block_size, 0.0)


async def test_the_simulator_counts_its_generate_requests_in_progress_as_running() -> None:
    sim = EngineSim(ttft_s=0.3)
    body = {"model": "tiny", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=sim.app())) as http:
        generate = asyncio.create_task(http.post("http://sim/inference/v1/generate", json=body))
        await asyncio.sleep(0.1)
        during = parse_engine_metrics((await http.get("http://sim/metrics")).text, at=0.0)
        assert (await generate).status_code == 200
        after = parse_engine_metrics((await http.get("http://sim/metrics")).text, at=0.0)
    assert (during.running, after.running) == (1, 0)


# -- the poller ---------------------------------------------------------------------------


async def test_a_failing_poll_feeds_nothing_and_is_logged_once_per_transition(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answers: list[httpx.Response | Exception] = [
        httpx.Response(200, text=TWO_CORES),
        httpx.ConnectError("refused"),
        httpx.Response(500, text="boom"),
        httpx.Response(200, text="garbage"),
        httpx.ReadTimeout("slow"),
        httpx.Response(200, text=TWO_CORES.replace("3.0", "8.0")),
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url == "http://a:1/metrics"
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    scheduler = _scheduler(LoadBalance())
    caplog.set_level(logging.INFO, logger="tito.engine_metrics")
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        poller = EngineMetricsPoller(A, scheduler, http, interval_s=0.01, timeout_s=1.0)
        await poller.poll()
        sampled = _latest(scheduler)
        assert (sampled.running, sampled.kv_capacity_tokens) == (4, 6400)
        for _ in range(4):
            await poller.poll()
            assert poller.failing and _latest(scheduler) is sampled  # left to go stale
        await poller.poll()
    assert not poller.failing and _latest(scheduler).running == 9
    records = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert len(records) == 2, records
    assert records[0][0] == logging.WARNING and "ConnectError" in records[0][1]
    assert records[1] == (logging.INFO, f"metrics of {A}: readable again")


def _latest(scheduler: Scheduler) -> EngineLoad:
    sample = scheduler.engine_loads.fresh(A, time.monotonic())
    assert sample is not None
    return sample


def test_pollers_only_when_the_engines_metrics_are_the_load_source() -> None:
    scheduler = _scheduler(LoadBalance())
    http = httpx.AsyncClient()
    pool = PoolConfig()
    assert instance_work(TitoConfig(), scheduler, http)(pool, pool.instances[0]) == []
    config = TitoConfig(scheduler=SchedulerConfig(load_source="engine_metrics"))
    (work,) = instance_work(config, scheduler, http)(pool, pool.instances[0])
    assert work.cr_frame.f_locals["self"].address == pool.instances[0].address  # type: ignore[attr-defined]
    work.close()
    with pytest.raises(ValueError):
        SchedulerConfig.model_validate({"load_source": "gossip"})
