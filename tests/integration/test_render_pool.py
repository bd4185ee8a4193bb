"""The render pool (RFC Render Pool) with real render processes.

- `tito up` runs the session stack with two render processes (`render_config.replicas: 2`):
  under concurrent load both render; one killed mid-load fails no client request (its renders
  retried on the other), its breaker opens, `tito up` restarts it and it rejoins; with both
  down the local tokenizer serves.
- A slow endpoint (a proxy adding latency in front of the real render) gets less traffic, and
  its saturation shows in the metrics and a warning log line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from ext_proc.config import Endpoint
from tests.conftest import RunningStack, SimGateway, metric, running_sim_gateway, scrape
from tests.render_proxy import RenderFault, RenderProxy, RenderProxyServer


def _chat(base_url: str, i: int, stream: bool = False) -> int:
    body = {
        "model": "tiny",  # the served name of the stack and of the slow pool's gateway
        "messages": [{"role": "user", "content": f"request {i}: " + "words " * (20 + 7 * (i % 5))}],
        "max_tokens": 4,
        "stream": stream,
    }
    response = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120, trust_env=False)
    return response.status_code


def _concurrently(n: int, call: Callable[[int], int], workers: int = 8) -> list[int]:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(call, range(n)))


def _render_pids(port: int) -> list[int]:
    """The render server processes listening on `port` (by their command lines)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"render" in b" ".join(argv) and str(port).encode() in argv:
            pids.append(int(entry.name))
    return pids


def _kill_render(port: int) -> None:
    pids = _render_pids(port)
    assert pids, f"no render process on port {port}"
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(pid), signal.SIGKILL)


def _endpoints(stack: RunningStack) -> dict[str, Any]:
    endpoints: dict[str, Any] = stack.states()[0]["render_endpoints"]
    return endpoints


def _wait(what: str, check: Callable[[], bool], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.5)


def _ok_renders(stack: RunningStack) -> dict[str, float]:
    samples = scrape(stack.admin_urls[0] + "/metrics")
    names = [e.address for e in stack.config.render_config.pool()]
    return {n: metric(samples, "tito_render_endpoint_seconds_count", endpoint=n, outcome="ok") for n in names}


def test_two_render_processes_share_the_load_survive_a_kill_and_rejoin(stack: RunningStack) -> None:
    first, second = (e.address for e in stack.config.render_config.pool())
    before = _ok_renders(stack)
    assert _concurrently(8, lambda i: _chat(stack.base_url, i, stream=i % 2 == 1)) == [200] * 8
    served = {n: v - before[n] for n, v in _ok_renders(stack).items()}
    assert served[first] > 0 and served[second] > 0, served  # both render under 8 concurrent requests

    # One render process killed while 48 requests are being served: none fails, and at least
    # one of them was rendered on the other after the killed one failed it.
    with ThreadPoolExecutor(8) as pool:
        results = pool.map(lambda i: _chat(stack.base_url, 100 + i), range(48))
        time.sleep(0.2)
        _kill_render(stack.config.render_config.pool()[1].port)
        statuses = list(results)
    assert statuses == [200] * 48
    killed = _endpoints(stack)[second]
    assert killed["outcomes"].get("retried", 0) >= 1 and killed["breaker"] != "closed", killed
    # Requests meanwhile render on the first endpoint (the second is skipped, not retried each time).
    assert _concurrently(4, lambda i: _chat(stack.base_url, 200 + i)) == [200] * 4

    # Both down: the local tokenizer serves, as with one render endpoint.
    _kill_render(stack.config.render_config.pool()[0].port)
    fallbacks = stack.states()[0]["tokenization"]["fallbacks"]
    assert _chat(stack.base_url, 300, stream=True) == 200
    after = stack.states()[0]["tokenization"]["fallbacks"]
    assert sum(after.values()) == sum(fallbacks.values()) + 1

    # `tito up` restarts both; a tiny real render lets each rejoin, and each renders again.
    _wait("both endpoints rejoin", lambda: {e["breaker"] for e in _endpoints(stack).values()} == {"closed"})
    assert any(line.startswith("render-1 exited with signal SIGKILL; restart") for line in stack.output)
    before = _ok_renders(stack)
    assert _concurrently(8, lambda i: _chat(stack.base_url, 400 + i)) == [200] * 8
    served = {n: v - before[n] for n, v in _ok_renders(stack).items()}
    assert served[first] > 0 and served[second] > 0, served


@pytest.fixture(scope="module")
def slow_pool(
    stack: RunningStack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[SimGateway, RenderProxy]]:
    """A gateway over a simulator whose render pool is the stack's render, directly and
    through a proxy that adds 500 ms to every render."""
    proxy = RenderProxy(stack.config.render_config.endpoint.url, faults=[RenderFault("render", "delay", delay_s=0.5)])
    server = RenderProxyServer(proxy).start()
    endpoints = [stack.config.render_config.endpoint, Endpoint(port=server.port)]
    render = {"endpoints": [e.model_dump() for e in endpoints], "p99_budget_ms": 250}
    try:
        with running_sim_gateway(
            stack, tmp_path_factory.mktemp("slowrender"), 1, render_config=render, logging={"format": "json"}
        ) as gateway:
            yield gateway, proxy
    finally:
        server.stop()


def test_a_slow_render_endpoint_gets_less_traffic_and_shows_its_saturation(
    slow_pool: tuple[SimGateway, RenderProxy],
) -> None:
    gateway, proxy = slow_pool
    fast, slow = (e.address for e in gateway.config.render_config.pool())
    for _ in range(4):
        assert _concurrently(8, lambda i: _chat(gateway.base_url, i), workers=4) == [200] * 8
    samples = gateway.metrics()
    renders = {n: metric(samples, "tito_render_endpoint_seconds_count", endpoint=n, outcome="ok") for n in (fast, slow)}
    assert renders[fast] + renders[slow] == 32
    assert renders[fast] > 3 * renders[slow] >= 3, renders  # the slow one is tried, then mostly spared
    assert len(proxy.calls_to("render")) == renders[slow]
    assert metric(samples, "tito_render_p99_ms", endpoint=slow) >= 500
    assert metric(samples, "tito_render_p99_ms", endpoint=fast) < 250
    log = gateway.gateway.processes["processor"].log_path.read_text()
    assert f"render endpoint {slow} is slow" in log and f"render endpoint {fast} is slow" not in log
