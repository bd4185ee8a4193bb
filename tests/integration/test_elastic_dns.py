"""A DNS-discovered pool through real parts: a real dnsmasq answers for the pool's name, a real
Envoy and processor serve, engine simulators on their own loopback addresses (one port, one A
record each: a headless Service's shape) join and leave while the gateway serves. Envoy is
never restarted or edited: it follows the endpoints file the processor writes."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import RunningStack, SimGateway, free_port, metric, missing, start_discovered_gateway
from tests.dns_server import DnsServer
from tests.engine_sim import EngineSim, Fault, SimServer

NAME = "sims.tito.test"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "where to?"}], "max_tokens": 4}


class Elastic:
    def __init__(self, gateway: SimGateway, dns: DnsServer, servers: list[SimServer], decoy: SimServer) -> None:
        self.gateway, self.dns, self.servers, self.decoy = gateway, dns, servers, decoy

    @property
    def sims(self) -> list[EngineSim]:
        return [s.sim for s in self.servers]

    def records(self, *sims: EngineSim) -> None:
        self.dns.records(NAME, [sim.host for sim in sims])

    def pool(self) -> dict[str, Any]:
        pool: dict[str, Any] = self.gateway.state()["pools"]["union"]
        return pool

    def wait_routes(self, *sims: EngineSim, timeout: float = 10) -> float:
        """Seconds until the processor routes to exactly these engines."""
        start, wanted = time.monotonic(), {sim.address: "routes" for sim in sims}
        while (instances := self.pool()["instances"]) != wanted:
            if time.monotonic() - start > timeout:
                raise AssertionError(f"routes to {instances}, not {sorted(wanted)}")
            time.sleep(0.02)
        return time.monotonic() - start

    def envoy(self) -> tuple[int, str]:
        """Envoy's process and its bootstrap, to show neither changes."""
        process = self.gateway.gateway.processes["envoy"].popen
        assert process is not None and process.poll() is None
        bootstrap = (self.gateway.gateway.work_dir / "envoy.yaml").read_bytes()
        return process.pid, hashlib.sha256(bootstrap).hexdigest()


@pytest.fixture(scope="module")
def elastic_gateway(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Elastic]:
    if not DnsServer.available():
        missing("dnsmasq (Debian package dnsmasq-base)")
    work = tmp_path_factory.mktemp("elastic")
    port = free_port()
    dns = DnsServer(work, free_port(), [NAME]).start()
    servers = [SimServer(EngineSim(host=f"127.0.0.{21 + k}", port=port)).start() for k in range(3)]
    decoy = SimServer(EngineSim(host="127.0.0.29", port=port)).start()  # never a member
    dns.records(NAME, [servers[0].sim.host])
    # (a short flap hold: the tests take the same engines in and out one after the other)
    discovery = {"source": "dns", "name": NAME, "port": port, "nameserver": dns.nameserver}
    discovery |= {"flap_hold_s": 0.5, "flap_hold_max_s": 1.0}
    try:
        config, gateway = start_discovered_gateway(
            stack, work, [{"name": "union", "role": "union", "discovery": discovery}]
        )
    except BaseException:
        dns.stop()
        raise
    elastic = Elastic(SimGateway(config, gateway, [s.sim for s in servers]), dns, servers, decoy)
    try:
        yield elastic
    finally:
        gateway.stop()
        dns.stop()
        for server in [*servers, decoy]:
            server.close()


@pytest.fixture
def elastic(elastic_gateway: Elastic) -> Iterator[Elastic]:
    """One member (the first simulator) before each test; nothing leaked after it."""
    elastic_gateway.records(elastic_gateway.sims[0])
    elastic_gateway.wait_routes(elastic_gateway.sims[0], timeout=15)
    elastic_gateway.decoy.sim.received.clear()
    elastic_gateway.gateway.restore()
    yield elastic_gateway
    elastic_gateway.gateway.assert_no_leaks()
    elastic_gateway.gateway.restore()


def _chat(base_url: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(base_url + "/v1/chat/completions", json=CHAT, headers=headers or {}, timeout=30)


def test_an_engine_added_at_run_time_serves_within_2s_through_the_same_envoy(elastic: Elastic) -> None:
    first, second = elastic.sims[:2]
    envoy_before = elastic.envoy()
    elastic.records(first, second)
    took = elastic.wait_routes(first, second)
    assert took < 2.0, f"the new engine routed {took:.2f} s after its record"
    for _ in range(6):
        assert _chat(elastic.gateway.base_url).status_code == 200
    assert first.generate_requests() and second.generate_requests()  # round robin over both
    assert elastic.envoy() == envoy_before  # same process, same bootstrap
    assert elastic.pool()["joins"] >= 2
    samples = elastic.gateway.metrics()
    assert metric(samples, "tito_pool_instances", pool="union", state="routes") == 2


def test_a_retry_falls_back_to_another_member(elastic: Elastic) -> None:
    first, second = elastic.sims[:2]
    elastic.records(first, second)
    elastic.wait_routes(first, second)
    shared = Fault("status", status=503, times=1)  # whichever is picked answers 503 once
    first.fault = second.fault = shared
    response = _chat(elastic.gateway.base_url)
    assert response.status_code == 200, response.text
    assert len(first.generate_requests()) == len(second.generate_requests()) == 1  # tried one, served by the other


def test_a_client_named_destination_reaches_nothing(elastic: Elastic) -> None:
    decoy = elastic.decoy.sim
    for header in ("x-gateway-destination-endpoint", "x-envoy-original-dst-host"):
        response = _chat(elastic.gateway.base_url, {header: decoy.address})
        assert response.status_code == 200, response.text
    assert decoy.received == []
    assert len(elastic.sims[0].generate_requests()) == 2


def test_a_leaving_engine_finishes_its_streams_and_takes_no_new_one(elastic: Elastic) -> None:
    first, second = elastic.sims[:2]
    elastic.records(first, second)
    elastic.wait_routes(first, second)
    for sim in (first, second):
        sim.token_delay_s = 0.05
    done: dict[str, httpx.Response] = {}
    body = {**CHAT, "max_tokens": 40, "stream": True}
    url = elastic.gateway.base_url + "/v1/chat/completions"
    stream = threading.Thread(target=lambda: done.setdefault("r", httpx.post(url, json=body, timeout=30)))
    stream.start()
    deadline = time.monotonic() + 5
    while not (first.generate_requests() or second.generate_requests()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    leaving, staying = (first, second) if first.generate_requests() else (second, first)
    elastic.records(staying)
    elastic.wait_routes(staying)
    assert _chat(elastic.gateway.base_url).status_code == 200
    stream.join(30)
    text = done["r"].text
    assert done["r"].status_code == 200 and text.endswith("data: [DONE]\n\n") and '"finish_reason":"length"' in text
    assert len(leaving.generate_requests()) == 1 and len(staying.generate_requests()) == 1
    state = elastic.gateway.assert_no_leaks()
    assert leaving.address not in state["scheduler"]["instances"]
    assert elastic.pool()["leaves"] >= 1


def test_an_instance_back_soon_after_leaving_is_damped(elastic: Elastic) -> None:
    first, second = elastic.sims[:2]
    elastic.records(first, second)
    elastic.wait_routes(first, second)
    elastic.records(first)
    elastic.wait_routes(first)
    elastic.records(first, second)  # back within the flap window: held before it routes
    deadline = time.monotonic() + 5
    while not elastic.pool()["instances"].get(second.address, "").startswith("damped"):
        assert time.monotonic() < deadline, elastic.pool()
        time.sleep(0.02)
    assert _chat(elastic.gateway.base_url).status_code == 200 and not second.generate_requests()
    elastic.wait_routes(first, second, timeout=5)  # after the hold (at most 1 s here)


def test_a_failed_lookup_keeps_the_last_membership(elastic: Elastic) -> None:
    first, second = elastic.sims[:2]
    elastic.records(first, second)
    elastic.wait_routes(first, second)
    elastic.dns.stop()
    try:
        time.sleep(3)  # several lookups (every second at most) fail meanwhile
        assert set(elastic.pool()["instances"]) == {first.address, second.address}
        for _ in range(4):
            assert _chat(elastic.gateway.base_url).status_code == 200
    finally:
        elastic.dns.start()
    elastic.records(first)
    elastic.wait_routes(first)


def test_no_record_is_a_pool_without_instances(elastic: Elastic) -> None:
    elastic.records()
    elastic.wait_routes()
    response = _chat(elastic.gateway.base_url)
    assert response.status_code == 503, response.text
    assert "no union engine instance" in response.json()["error"]["message"]
    ready = httpx.get(f"http://127.0.0.1:{elastic.gateway.config.processor.admin_port}/ready", timeout=5)
    assert ready.status_code == 503
    endpoints = Path(elastic.gateway.config.listener.engine_endpoints_file).read_text()
    assert '"lb_endpoints":[]' in endpoints
