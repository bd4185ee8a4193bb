"""Scheduling on real token ids through real Envoy and the real render sidecar, over engine
simulators: affinity, load spread, admission, breakers with Envoy retries, context budget."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import RunningStack, SimGateway, start_sim_gateway
from tests.engine_sim import SimServer

SYSTEM = " ".join(f"Rule {n}: answer politely, cite sources, and keep the tone friendly 你好." for n in range(12))


class Gateways:
    """Per-test gateways over fresh simulators, stopped afterwards."""

    def __init__(self, stack: RunningStack, tmp: Path) -> None:
        self._stack, self._tmp = stack, tmp
        self._started: list[tuple[SimGateway, list[SimServer]]] = []

    def start(self, n_engines: int, kv_events: bool = False, **sections: Any) -> tuple[SimGateway, list[SimServer]]:
        work = self._tmp / f"gw{len(self._started)}"
        started = start_sim_gateway(self._stack, work, n_engines, kv_events=kv_events, **sections)
        self._started.append(started)
        return started

    def stop(self) -> None:
        for gateway, servers in self._started:
            gateway.gateway.stop()
            for server in servers:
                server.close()


def _start_in(gateways: Gateways, prefix_source: str, n_engines: int, policy: str) -> SimGateway:
    """A gateway whose prefix index is fed by the simulators' KV cache events (vLLM's own
    publisher and block hash), or by its own routing records; event-fed instances are
    checked to be so at the start (and by the test, at its end)."""
    events = prefix_source == "kv_events"
    scheduler = {"policy": policy, "prefix_source": prefix_source}
    gateway, _ = gateways.start(n_engines, kv_events=events, scheduler=scheduler)
    if events:
        _until_sources(gateway, "kv_events")
    return gateway


def _until_sources(gateway: SimGateway, source: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while {i["prefix_source"] for i in gateway.state()["scheduler"]["instances"].values()} != {source}:
        assert time.monotonic() < deadline, gateway.state()["scheduler"]["instances"]
        time.sleep(0.05)


PREFIX_SOURCES = pytest.mark.parametrize("prefix_source", ["routing", "kv_events"])


@pytest.fixture
def gateways(stack: RunningStack, tmp_path: Path) -> Iterator[Gateways]:
    started = Gateways(stack, tmp_path)
    yield started
    started.stop()


def _chat(system: str, user: str, max_tokens: int = 4, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def _landed(gateway: SimGateway) -> dict[str, int]:
    """Engine request id -> index of the simulator that received it."""
    return {r.headers["x-request-id"]: n for n, sim in enumerate(gateway.sims) for r in sim.generate_requests()}


async def _wait_state(gateway: SimGateway, done: Any, timeout: float = 15) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        state = gateway.state()
        if done(state) or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.05)


async def _stream_all(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> bytes:
    async with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        return b"".join([chunk async for chunk in response.aiter_raw()])


def _render_demand(stack: RunningStack, body: dict[str, Any]) -> int:
    url = stack.config.render_config.endpoint.url + "/v1/chat/completions/render"
    rendered = httpx.post(url, json=body, timeout=10, trust_env=False).json()
    return len(rendered["token_ids"]) + int(body["max_tokens"])


@PREFIX_SOURCES
async def test_shared_prefix_lands_where_it_was_served_and_new_prefixes_spread(
    gateways: Gateways, prefix_source: str
) -> None:
    gateway = _start_in(gateways, prefix_source, 4, "kv_cache_affinity")
    for sim in gateway.sims:
        sim.token_delay_s = 0.1
    url = gateway.base_url + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        ids = []
        for n in range(6):  # one after the other: no load anywhere, only the cache differs
            response = await client.post(url, json=_chat(SYSTEM, f"question {n}?"))
            assert response.status_code == 200
            ids.append(response.json()["id"])
        landed = _landed(gateway)
        assert len({landed[i] for i in ids}) == 1, [landed[i] for i in ids]

        # New, different prefixes at the same time: nothing cached, so load decides.
        gateway.reset()
        bodies = [_chat(f"Persona {n}: {'x' * 40 * (n + 1)}", "hello", max_tokens=30, stream=True) for n in range(4)]
        await asyncio.gather(*(_stream_all(client, url, b) for b in bodies))
    assert sorted(len(sim.generate_requests()) for sim in gateway.sims) == [1, 1, 1, 1]
    _until_sources(gateway, prefix_source)  # events did the work, not the fallback


@PREFIX_SOURCES
async def test_load_balance_keeps_active_tokens_within_one_request(
    gateways: Gateways, stack: RunningStack, prefix_source: str
) -> None:
    gateway = _start_in(gateways, prefix_source, 4, "load_balance")
    for sim in gateway.sims:
        sim.token_delay_s = 0.1
    bodies = [_chat("short", "tell me" + " more" * n, max_tokens=40, stream=True) for n in range(10)]
    biggest = max(_render_demand(stack, b) for b in bodies)
    url = gateway.base_url + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        streams = asyncio.gather(*(_stream_all(client, url, b) for b in bodies))
        state = await _wait_state(gateway, lambda s: s["scheduler"]["active_requests"] == len(bodies))
        await streams
    loads = [i["active_tokens"] for i in state["scheduler"]["instances"].values()]
    assert state["scheduler"]["active_requests"] == len(bodies)
    assert max(loads) - min(loads) <= biggest, loads


async def test_admission_rejects_beyond_budget_and_releases_on_every_exit(
    gateways: Gateways, stack: RunningStack
) -> None:
    long_stream = _chat("be verbose", "write a long story", max_tokens=200, stream=True)
    demand = _render_demand(stack, long_stream)
    gateway, _ = gateways.start(2, admission={"global_token_budget": 2 * demand + demand // 2})
    for sim in gateway.sims:
        sim.token_delay_s = 0.02
    url = gateway.base_url + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        finishes = asyncio.create_task(_stream_all(client, url, long_stream))
        async with client.stream("POST", url, json=long_stream) as leaver:
            assert leaver.status_code == 200
            await _wait_state(gateway, lambda s: s["scheduler"]["active_requests"] == 2)

            rejected = await client.post(url, json=long_stream)
            assert rejected.status_code == 429
            assert rejected.json()["error"]["code"] == "token_budget_exceeded"
            # rejected at once: both admitted streams are still running
            assert gateway.state()["scheduler"]["active_requests"] == 2
            async for _ in leaver.aiter_raw():
                break  # the client reads one chunk and disconnects
        body = await finishes
    assert body.endswith(b"data: [DONE]\n\n")
    state = await _wait_state(
        gateway, lambda s: s["active_exchanges"] == 0 and s["scheduler"]["total_active_tokens"] == 0
    )
    assert state["active_exchanges"] == 0
    assert state["scheduler"]["total_active_tokens"] == 0
    assert all(i["active_requests"] == 0 for i in state["scheduler"]["instances"].values())


def test_refused_instance_is_retried_then_broken_then_probed(gateways: Gateways) -> None:
    # The cool-down outlasts the three requests that must find the breaker open, however
    # slow the machine (each takes well under a second); the probe loop waits it out.
    breaker = {"failure_threshold": 2, "base_cooldown_s": 5.0, "max_cooldown_s": 10.0}
    # (capability negotiation off: its liveness check would take the dead engine out first)
    scheduler = {"policy": "round_robin", "breaker": breaker}
    gateway, servers = gateways.start(2, scheduler=scheduler, capabilities={"enable": False})
    dead = gateway.sims[0]
    servers[0].stop()  # refuses connections from now on
    url = gateway.base_url + "/v1/chat/completions"

    def ask(stream: bool = False) -> None:
        response = httpx.post(url, json=_chat("s", "hi", stream=stream), timeout=30, trust_env=False)
        assert response.status_code == 200  # Envoy retried on the fallback before the first byte
        if stream:
            assert response.text.endswith("data: [DONE]\n\n") and response.text.count("[DONE]") == 1
        else:
            assert response.json()["object"] == "chat.completion"

    def breaker_of(sim_index: int) -> dict[str, Any]:
        instance: dict[str, Any] = gateway.state()["scheduler"]["instances"][gateway.sims[sim_index].address]
        return instance

    for n in range(4):
        ask(stream=n == 2)
    assert breaker_of(0)["breaker"] == "open" and breaker_of(0)["consecutive_failures"] == 2
    assert breaker_of(1)["breaker"] == "closed"
    served = len(gateway.sims[1].generate_requests())
    for _ in range(3):
        ask()
    assert len(gateway.sims[1].generate_requests()) == served + 3
    assert breaker_of(0)["breaker"] == "open"  # not tried while open

    servers[0].restart()
    # After the cool-down (doubled if a probe already failed while it was down), one request
    # probes it; keep asking until it does.
    deadline = time.monotonic() + 30
    while not dead.generate_requests() and time.monotonic() < deadline:
        time.sleep(0.2)
        ask()
    assert len(dead.generate_requests()) == 1  # the half-open probe reached it
    assert breaker_of(0)["breaker"] == "closed"


def test_context_budget_clamps_max_tokens_and_rejects_what_cannot_fit(gateways: Gateways, stack: RunningStack) -> None:
    gateway, _ = gateways.start(1, scheduler={"context_budget_mode": "on"}, model={"max_model_len": 64})
    url = gateway.base_url + "/v1/chat/completions"
    fits = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}
    prompt_tokens = _render_demand(stack, fits) - 500
    response = httpx.post(url, json=fits, timeout=30, trust_env=False)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 64 - prompt_tokens
    [received] = gateway.sims[0].generate_requests()
    assert received.json()["sampling_params"]["max_tokens"] == 64 - prompt_tokens

    too_long = {"model": "tiny", "messages": [{"role": "user", "content": SYSTEM}], "max_tokens": 5}
    rejected = httpx.post(url, json=too_long, timeout=30, trust_env=False)
    assert rejected.status_code == 400
    assert rejected.json()["error"]["code"] == "context_length_exceeded"
    assert len(gateway.sims[0].generate_requests()) == 1
