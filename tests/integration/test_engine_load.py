"""Load from the engines (scheduler.load_source: engine_metrics) through the real Envoy +
processor over two engine simulators: what an engine reports of other gateways' traffic
steers requests away from it; an engine whose metrics fail goes back to the ledger without a
failed request; with the default (ledger) the reports are never even fetched. And the reader
against a real vLLM engine's /metrics."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ext_proc.fleet.engine_metrics import CACHE_INFO, KV_USAGE, RUNNING, WAITING, parse_engine_metrics
from tests.conftest import RunningStack, SimGateway, metric, running_sim_gateway, scrape

INTERVAL_S = 0.2
STALE_S = 1.0
HEAVY = (40, 10, 0.9)  # other gateways' requests on an engine: running, waiting, KV usage
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Balance me"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def metrics_gateway(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimGateway]:
    scheduler = {
        "policy": "load_balance",
        "load_source": "engine_metrics",
        "engine_metrics_interval_s": INTERVAL_S,
        "engine_metrics_stale_s": STALE_S,
    }
    with running_sim_gateway(stack, tmp_path_factory.mktemp("enginemetrics"), 2, scheduler=scheduler) as gateway:
        yield gateway


@pytest.fixture
def gateway(metrics_gateway: SimGateway) -> Iterator[SimGateway]:
    yield metrics_gateway
    for sim in metrics_gateway.sims:
        sim.external_load = (0, 0, 0.0)
        sim.metrics_status = 200
    metrics_gateway.reset()


def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert condition()


def _instance(gateway: SimGateway, n: int) -> dict[str, Any]:
    instance: dict[str, Any] = gateway.state()["scheduler"]["instances"][gateway.sims[n].address]
    return instance


def _reported_running(gateway: SimGateway, n: int) -> int | None:
    engine = _instance(gateway, n).get("engine")
    return None if engine is None else int(engine["running"])


def _landed(gateway: SimGateway, requests: int) -> list[int]:
    """Sequential requests, every one answered 200: how many generate requests each sim got."""
    gateway.reset()
    for _ in range(requests):
        response = httpx.post(gateway.base_url + "/v1/chat/completions", json=BODY, timeout=10, trust_env=False)
        assert response.status_code == 200, response.text
    return [len(sim.generate_requests()) for sim in gateway.sims]


def test_an_engine_reporting_other_traffic_gets_none_until_it_clears(gateway: SimGateway) -> None:
    gateway.sims[0].external_load = HEAVY
    _until(lambda: _reported_running(gateway, 0) == HEAVY[0])
    assert [_instance(gateway, n)["load_source"] for n in (0, 1)] == ["engine_metrics", "engine_metrics"]
    assert _instance(gateway, 0)["engine"]["kv_usage"] == 0.9 and _instance(gateway, 0)["engine"]["waiting"] == 10
    assert _landed(gateway, 8) == [0, 8]  # this gateway's own ledger is empty on both between requests

    gateway.sims[0].external_load = (0, 0, 0.0)
    _until(lambda: _reported_running(gateway, 0) == 0)
    spread = _landed(gateway, 10)
    assert min(spread) >= 3, spread
    gateway.assert_no_leaks()  # the polls hold no stream


def test_failing_metrics_fall_back_to_the_ledger_without_a_failed_request(gateway: SimGateway) -> None:
    sim = gateway.sims[0]
    sim.external_load = HEAVY
    _until(lambda: _reported_running(gateway, 0) == HEAVY[0])
    sim.metrics_status = 500
    _until(lambda: _instance(gateway, 0)["load_source"] == "ledger", timeout=STALE_S + 3)
    assert _instance(gateway, 1)["load_source"] == "engine_metrics"
    assert _instance(gateway, 0)["engine"]["running"] == HEAVY[0]  # the last sample, shown as stale
    # its stale report steers nothing: the ledger alone, a lower bound, makes it the first choice
    assert _landed(gateway, 6)[0] >= 3

    warning = f"metrics of {sim.address}: MetricsUnreadable: HTTP 500"
    log = gateway.gateway.processes["processor"].log_path
    assert log.read_text().count(warning) == 1  # once, though many polls failed
    sim.metrics_status = 200
    _until(lambda: _instance(gateway, 0)["load_source"] == "engine_metrics")
    _until(lambda: log.read_text().count(f"metrics of {sim.address}: readable again") == 1)
    assert _landed(gateway, 4) == [0, 4]


def test_with_the_default_ledger_source_engine_reports_are_ignored(stack: RunningStack, tmp_path: Path) -> None:
    with running_sim_gateway(stack, tmp_path, 2, scheduler={"policy": "load_balance"}) as gateway:
        gateway.sims[0].external_load = HEAVY
        time.sleep(5 * INTERVAL_S)
        assert _landed(gateway, 8) == [4, 4]
        assert all(_instance(gateway, n)["load_source"] == "ledger" for n in (0, 1))
        assert "engine" not in _instance(gateway, 0)
        assert [r.path for sim in gateway.sims for r in sim.received if r.path == "/metrics"] == []


def test_the_reader_matches_a_real_vllm_engines_metrics(stack: RunningStack) -> None:
    """The real engine's exposition, read by prometheus_client's own parser as the reference."""
    text = httpx.get(stack.engine_url + "/metrics", timeout=10, trust_env=False).text
    load = parse_engine_metrics(text, at=0.0)
    samples = scrape(stack.engine_url + "/metrics")
    info = [dict(labels) for (name, labels) in samples if name == CACHE_INFO]
    assert len(info) == 1 and int(info[0]["num_gpu_blocks"]) > 0
    assert load.kv_capacity_tokens == int(info[0]["num_gpu_blocks"]) * int(info[0]["block_size"])
    assert (load.running, load.waiting) == (metric(samples, RUNNING), metric(samples, WAITING))
    assert load.kv_usage == metric(samples, KV_USAGE)
