"""`processor.workers: 2` (`tito processor --workers 2`) behind real Envoy, over engine
simulators: Envoy spreads streams over both processes, the admission budget holds across
them, a dead worker comes back while the other serves, SIGTERM drains both."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

from tests.conftest import RunningStack, SimGateway, metric, running_sim_gateway, scrape

BUDGET = 3000  # the whole gateway's: each of the 2 workers admits 1,500
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "write a story"}], "max_tokens": 600}


@pytest.fixture(scope="module")
def workers(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimGateway]:
    with running_sim_gateway(
        stack,
        tmp_path_factory.mktemp("workers"),
        2,
        processor={"workers": 2},
        scheduler={"policy": "round_robin"},
        admission={"global_token_budget": BUDGET},
    ) as gateway:
        yield gateway


def _admin(gateway: SimGateway, path: str) -> list[str]:
    """`path` on every worker's admin port, worker 0 first."""
    return [f"http://127.0.0.1:{admin}{path}" for _, admin in gateway.config.processor.worker_ports()]


def _states(gateway: SimGateway) -> list[dict[str, Any]]:
    return [httpx.get(url, timeout=5, trust_env=False).json() for url in _admin(gateway, "/debug/state")]


def _served(gateway: SimGateway) -> list[float]:
    return [metric(scrape(url), "tito_requests_total", status="200") for url in _admin(gateway, "/metrics")]


def _worker_pid(gateway: SimGateway, index: int) -> int:
    """The pid listening on worker `index`'s port (ValueError: none yet; psutil may also not
    name the owner of a socket a process is still setting up)."""
    port, _ = gateway.config.processor.worker_ports()[index]
    pids = {c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.status == "LISTEN"}
    if len(pids) != 1 or None in pids:
        raise ValueError(f"worker {index} on port {port}: listening pids {pids}")
    return int(pids.pop())


async def _post(client: httpx.AsyncClient, gateway: SimGateway, **extra: Any) -> httpx.Response:
    return await client.post(gateway.base_url + "/v1/chat/completions", json={**BODY, "max_tokens": 4, **extra})


async def test_envoy_spreads_streams_over_both_workers(workers: SimGateway) -> None:
    # Envoy's worker threads learn a host passed its health check a moment after its admin
    # shows it: until then streams go to the worker that passed first.
    deadline = time.monotonic() + 10
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        while min(_served(workers)) == 0 and time.monotonic() < deadline:
            assert (await _post(client, workers)).status_code == 200
            await asyncio.sleep(0.2)
    before = _served(workers)
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        for _ in range(4):
            answers = await asyncio.gather(*(_post(client, workers) for _ in range(4)))
            assert [a.status_code for a in answers] == [200] * 4
    served = [after - earlier for after, earlier in zip(_served(workers), before, strict=True)]
    assert sum(served) == 16 and min(served) > 0, served  # each worker took some, none was counted twice


async def test_the_admission_budget_holds_across_workers(workers: SimGateway) -> None:
    """Each worker enforces half the budget on its own ledger: 8 concurrent streams of
    ~610 tokens each, at most 2 admitted per worker (2 × 610 ≤ 1,500 < 3 × 610)."""
    assert [s["scheduler"]["token_budgets"]["global"] for s in _states(workers)] == [BUDGET // 2] * 2
    for sim in workers.sims:
        sim.token_delay_s = 0.01  # 600 tokens: 6 s, while all 8 arrive
    url = workers.base_url + "/v1/chat/completions"
    try:
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:

            async def stream() -> int:
                async with client.stream("POST", url, json={**BODY, "stream": True}) as response:
                    await response.aread()
                    if response.status_code == 429:
                        assert response.json()["error"]["code"] == "token_budget_exceeded"
                    return response.status_code

            streams = asyncio.gather(*(stream() for _ in range(8)))
            peak = 0
            while not streams.done():
                peak = max(peak, sum(s["scheduler"]["total_active_tokens"] for s in _states(workers)))
                await asyncio.sleep(0.05)
            codes = await streams
    finally:
        for sim in workers.sims:
            sim.token_delay_s = 0.0
    assert 0 < peak <= BUDGET, peak
    assert sorted(codes) == [200] * codes.count(200) + [429] * codes.count(429)
    assert 2 <= codes.count(200) <= 4 and codes.count(429) >= 4, codes
    assert all(s["scheduler"]["total_active_tokens"] == 0 for s in _states(workers))


async def test_a_dead_worker_is_restarted_while_the_other_serves(workers: SimGateway) -> None:
    victim = _worker_pid(workers, 1)
    os.kill(victim, signal.SIGKILL)
    codes: list[int] = []
    deadline = time.monotonic() + 60
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        while time.monotonic() < deadline:
            codes.append((await _post(client, workers)).status_code)
            try:
                if _worker_pid(workers, 1) != victim and httpx.get(_admin(workers, "/ready")[1], timeout=2).is_success:
                    break
            except (ValueError, httpx.HTTPError):
                pass  # not back yet
            await asyncio.sleep(0.2)
        assert _worker_pid(workers, 1) != victim, "the supervisor did not restart the worker"
        # Back in Envoy's rotation once its health check passes: requests reach it again.
        served = _served(workers)[1]
        for _ in range(30):
            codes.append((await _post(client, workers)).status_code)
            if _served(workers)[1] > served:
                break
            await asyncio.sleep(0.5)
    assert _served(workers)[1] > served
    # The stream that finds the dead worker's port refused gets a 503 (Envoy does not retry an
    # ext_proc stream) and the worker is ejected at once: at most one per Envoy worker thread.
    assert codes.count(200) >= len(codes) - 2 and set(codes) <= {200, 503}, codes


def test_sigterm_drains_every_worker_and_the_supervisor_exits_0(workers: SimGateway) -> None:
    supervisor = workers.gateway.processes["processor"].popen
    assert supervisor is not None
    deadline = time.monotonic() + 30  # (a worker restarted by the test before may be starting)
    while True:
        try:
            worker_pids = [_worker_pid(workers, i) for i in range(2)]
            break
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(60) == 0
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in worker_pids)
