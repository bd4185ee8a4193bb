"""Operating the gateway, through real Envoy and the real render sidecar over engine
simulators: one trace per request joined to the client's and the engine's, `/ready` following
the engines' breakers, and SIGTERM draining open streams while new ones are refused."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ext_proc.config import Endpoint, TitoConfig
from ext_proc.observability.request import Observability
from ext_proc.observability.tracing import tracer_with
from ext_proc.server import serve
from ext_proc.tools.local_stack import LocalStack
from tests.conftest import RunningStack, SimGateway, gateway_config, metric, start_sim_gateway
from tests.engine_sim import EngineSim, Fault, SimServer

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "trace me"}], "max_tokens": 6}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class InProcessGateway:
    """Envoy as a process, the processor in a thread of this test process, so its spans go
    to an in-memory exporter the test reads."""

    def __init__(self, config: TitoConfig, work: Path, exporter: InMemorySpanExporter) -> None:
        self.config = config
        self._observability = Observability(tracer=tracer_with(exporter, batch=False))
        self._envoy = LocalStack(config, work)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)
        self._ready = threading.Event()

    async def _serve(self) -> None:
        self._loop, self._stop, ready = asyncio.get_running_loop(), asyncio.Event(), asyncio.Event()
        server = asyncio.create_task(serve(self.config, ready, self._stop, self._observability))
        await ready.wait()
        self._ready.set()
        await server

    def start(self) -> InProcessGateway:
        self._thread.start()
        assert self._ready.wait(120), "the in-process processor did not start"
        self._envoy.start_envoy()
        self._envoy.wait_ready()
        return self

    def stop(self) -> None:
        self._envoy.stop()
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


@pytest.fixture
def traced(stack: RunningStack, tmp_path: Path) -> Iterator[tuple[InProcessGateway, EngineSim, InMemorySpanExporter]]:
    server = SimServer(EngineSim()).start()
    model = {**stack.config.model.model_dump(), "path": stack.model_path}
    config = gateway_config(
        tmp_path,
        stack.config.render_config.endpoint.port,
        [Endpoint(port=server.sim.port)],
        stack.model_path,
        model=model,
        processor={"drain_timeout_s": 0.1},
    )
    exporter = InMemorySpanExporter()
    gateway = InProcessGateway(config, tmp_path, exporter).start()
    yield gateway, server.sim, exporter
    gateway.stop()
    server.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_one_trace_per_request_joined_to_the_client_and_the_engine(
    traced: tuple[InProcessGateway, EngineSim, InMemorySpanExporter], stream: bool
) -> None:
    gateway, sim, exporter = traced
    traceparent = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
    response = httpx.post(
        f"http://127.0.0.1:{gateway.config.listener.port}/v1/chat/completions",
        json={**CHAT, "stream": stream},
        headers={"traceparent": traceparent},
        timeout=30,
        trust_env=False,
    )
    assert response.status_code == 200
    spans = _finished(exporter, "tito chat")
    assert {f"{s.context.trace_id:032x}" for s in spans} == {TRACE_ID}  # one trace: the client's
    [request] = [s for s in spans if s.name == "tito chat"]
    assert f"{request.parent.span_id:016x}" == CLIENT_SPAN
    assert request.attributes["tito.request_id"] == response.headers["x-request-id"]
    children = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == request.context.span_id}
    assert sorted(children) == ["derender", "generate", "render", "schedule"]
    assert children["render"].attributes["tito.source"] == "render"
    assert children["derender"].attributes["tito.timed_chunks"] >= 1
    assert children["schedule"].attributes["tito.prompt_tokens"] > 0
    for child in children.values():  # inside the request's span
        assert request.start_time <= child.start_time <= child.end_time <= request.end_time
    # The engine got the generate span's context: its own spans join the same trace.
    [generate] = sim.generate_requests()
    version, trace_id, parent_id, _ = generate.headers["traceparent"].split("-")
    assert (version, trace_id, parent_id) == ("00", TRACE_ID, f"{children['generate'].context.span_id:016x}")


def _finished(exporter: InMemorySpanExporter, root: str, timeout: float = 5) -> list[Any]:
    """The spans once the request's own has ended (it ends after the client's last byte)."""
    deadline = time.monotonic() + timeout
    while not any(s.name == root for s in exporter.get_finished_spans()) and time.monotonic() < deadline:
        time.sleep(0.02)
    spans = list(exporter.get_finished_spans())
    exporter.clear()
    return spans


# -- readiness and drain ------------------------------------------------------------------------


@pytest.fixture
def one_engine(stack: RunningStack, tmp_path: Path) -> Iterator[SimGateway]:
    gateway, servers = start_sim_gateway(
        stack,
        tmp_path,
        1,
        scheduler={"breaker": {"failure_threshold": 1, "base_cooldown_s": 3.0}},
        processor={"drain_timeout_s": 5.0},
        derender={"stream_interval": 4},  # drain with several tokens per engine event
    )
    yield gateway
    gateway.gateway.stop()
    for server in servers:
        server.stop()


def _ready(gateway: SimGateway) -> tuple[int, dict[str, Any]]:
    response = httpx.get(f"http://127.0.0.1:{gateway.config.processor.admin_port}/ready", timeout=5, trust_env=False)
    return response.status_code, response.json()


def _post(gateway: SimGateway, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gateway.base_url + "/v1/chat/completions", json=body, timeout=30, trust_env=False)


def test_every_engine_breaker_open_still_routes_and_stays_ready(one_engine: SimGateway) -> None:
    """The only engine's breaker open: requests still go to it (panic routing, as Envoy routes
    a pool whose every host is ejected), counted, and `/ready` stays 200 (it routes); its
    first success closes the breaker. Without panic routing the same state is a 503 and
    not ready (`tests/unit/test_admin_ready.py`)."""
    ready = {"ready": True, "serving": True, "tokenization": True, "engines": True, "capabilities": True}
    assert _ready(one_engine) == (200, ready)
    one_engine.sims[0].fault = Fault("status", status=500)
    assert _post(one_engine, CHAT).status_code == 500  # the failure opens the only breaker
    instance = one_engine.sims[0].address
    assert one_engine.state()["scheduler"]["instances"][instance]["breaker"] == "open"
    assert _ready(one_engine) == (200, ready)
    assert _post(one_engine, CHAT).status_code == 500  # tried in panic, not refused by the gateway
    samples = one_engine.metrics()
    assert metric(samples, "tito_breaker_transitions_total", instance=instance, state="open") == 1
    assert metric(samples, "tito_breaker_panics_total", role="union") == 1
    assert len(one_engine.sims[0].generate_requests()) == 2
    one_engine.sims[0].fault = None  # the engine recovers: the next request, still in panic, closes it
    assert _post(one_engine, CHAT).status_code == 200
    samples = one_engine.metrics()
    assert metric(samples, "tito_breaker_transitions_total", instance=instance, state="closed") == 1
    assert metric(samples, "tito_breaker_panics_total", role="union") == 2
    one_engine.assert_no_leaks()


def _stream(gateway: SimGateway, results: list[bytes], max_tokens: int) -> threading.Thread:
    def run() -> None:
        body = {**CHAT, "stream": True, "max_tokens": max_tokens}
        with httpx.stream(
            "POST", gateway.base_url + "/v1/chat/completions", json=body, timeout=60, trust_env=False
        ) as response:
            results.append(response.read())

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _wait_streams(gateway: SimGateway, n: int) -> None:
    deadline = time.monotonic() + 10
    while gateway.state()["active_exchanges"] < n and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gateway.state()["active_exchanges"] == n


def test_sigterm_lets_open_streams_finish_and_refuses_new_ones(one_engine: SimGateway) -> None:
    sim = one_engine.sims[0]
    sim.token_delay_s = 0.1  # 20 tokens: 2 s per stream, well inside the 5 s drain
    results: list[bytes] = []
    threads = [_stream(one_engine, results, 20) for _ in range(4)]
    _wait_streams(one_engine, 4)
    processor = one_engine.gateway.processes["processor"].popen
    assert processor is not None
    processor.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    assert _ready(one_engine)[0] == 503
    refused = _post(one_engine, CHAT)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    for thread in threads:
        thread.join(30)
    assert len(results) == 4
    for body in results:  # every open stream ended normally: its whole answer, one [DONE]
        events = [e.removeprefix("data: ") for e in body.decode().split("\n\n") if e]
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        assert orjson.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert processor.wait(10) == 0
    generated = sim.generate_requests()
    assert len(generated) == 4  # the refused one reached no engine
    assert {r.json()["sampling_params"]["stream_interval"] for r in generated} == {4}


def test_streams_past_the_drain_timeout_end_with_an_error_event(stack: RunningStack, tmp_path: Path) -> None:
    gateway, servers = start_sim_gateway(
        stack, tmp_path, 1, processor={"drain_timeout_s": 0.5}, derender={"stream_interval": 4}
    )
    try:
        gateway.sims[0].token_delay_s = 0.2  # 100 tokens: 20 s, far past the drain timeout
        results: list[bytes] = []
        thread = _stream(gateway, results, 100)
        _wait_streams(gateway, 1)
        processor = gateway.gateway.processes["processor"].popen
        assert processor is not None
        processor.send_signal(signal.SIGTERM)
        thread.join(30)
        events = [e.removeprefix("data: ") for e in results[0].decode().split("\n\n") if e]
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        assert orjson.loads(events[-2])["error"]["code"] == "draining"
        assert processor.wait(10) == 0
        deadline = time.monotonic() + 5  # and the engine is not left generating for nobody
        while gateway.sims[0].streams_cut < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gateway.sims[0].streams_cut == 1
    finally:
        gateway.gateway.stop()
        for server in servers:
            server.stop()
