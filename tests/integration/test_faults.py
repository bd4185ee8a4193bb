"""Every row of the RFC fault table through real Envoy and the real render sidecar (behind a
fault-injecting proxy), over engine simulators. Each test also proves nothing leaked."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import RunningStack, SimGateway, free_port, metric, start_sim_gateway
from tests.engine_sim import NATIVE_TEXT, Fault, SimServer
from tests.render_proxy import RenderFault, RenderProxy, RenderProxyServer

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello 世界"}], "max_tokens": 5}
STREAM = {**CHAT, "stream": True}


class FaultBench:
    """A gateway whose render is the real sidecar behind a fault proxy, over simulators."""

    def __init__(self, stack: RunningStack, tmp: Path) -> None:
        self.stack, self.tmp = stack, tmp
        self.proxy = RenderProxy(stack.config.render_config.endpoint.url)
        self.proxy_server = RenderProxyServer(self.proxy)
        self.gateway: SimGateway | None = None
        self.servers: list[SimServer] = []

    def start(self, n_engines: int = 1, proxy_up: bool = True, **sections: Any) -> SimGateway:
        if proxy_up:
            self.proxy_server.start()
        else:
            self.proxy_server.port = free_port()  # nothing listens there yet
        sections.setdefault("logging", {"format": "json"})  # stage lines the tests read back
        self.gateway, self.servers = start_sim_gateway(
            self.stack, self.tmp, n_engines, render_port=self.proxy_server.port, **sections
        )
        return self.gateway

    def post(self, body: dict[str, Any] | bytes, path: str = "/v1/chat/completions", **kw: Any) -> httpx.Response:
        assert self.gateway is not None
        content = body if isinstance(body, bytes) else orjson.dumps(body)
        headers = kw.pop("headers", {"content-type": "application/json"})
        return httpx.post(
            self.gateway.base_url + path, content=content, headers=headers, timeout=30, trust_env=False, **kw
        )

    def started(self) -> SimGateway:
        assert self.gateway is not None
        return self.gateway

    def forget(self) -> None:
        """No fault scripted, and what the proxy and the engines saw forgotten: a test of its
        own on a gateway shared by tests that leave no state on it (breaker, fallback)."""
        self.proxy.faults.clear()
        self.proxy.calls.clear()
        for sim in self.started().sims:
            sim.fault = None
            sim.received.clear()

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.gateway.stop()
        for server in self.servers:
            server.stop()
        self.proxy_server.stop()


@pytest.fixture
def bench(stack: RunningStack, tmp_path: Path) -> Iterator[FaultBench]:
    """A gateway of the test's own (started with the test's config): for faults that leave
    state behind. A start costs seconds (the processor imports vLLM)."""
    started = FaultBench(stack, tmp_path)
    yield started
    started.stop()


@contextlib.contextmanager
def _shared(stack: RunningStack, work: Path, **sections: Any) -> Iterator[FaultBench]:
    started = FaultBench(stack, work)
    try:
        started.start(**sections)
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def _default_bench(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultBench]:
    with _shared(stack, tmp_path_factory.mktemp("faults-default")) as started:
        yield started


@pytest.fixture
def shared(_default_bench: FaultBench) -> FaultBench:
    """The module's gateway of the default config, for tests that script no fault: each test
    starts from nothing seen."""
    _default_bench.forget()
    return _default_bench


@pytest.fixture(scope="module")
def _sidecar_bench(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultBench]:
    sections = {"render_config": {"timeout_ms": 800}, "derender": {"mode": "sidecar"}}
    with _shared(stack, tmp_path_factory.mktemp("faults-derender"), **sections) as started:
        yield started


@pytest.fixture
def sidecar(_sidecar_bench: FaultBench) -> FaultBench:
    """The module's gateway that derenders through the sidecar, for the derender faults: none
    counts against a breaker (each test checks). Each test starts from nothing seen."""
    _sidecar_bench.forget()
    return _sidecar_bench


def _sse_events(text: str) -> list[str]:
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e]


def _native_calls(gateway: SimGateway) -> list[Any]:
    return [r for sim in gateway.sims for r in sim.received if r.path.startswith("/v1/")]


def _generate_calls(gateway: SimGateway) -> list[Any]:
    return [r for sim in gateway.sims for r in sim.generate_requests()]


# -- Render Token In: fallback to the lazily loaded local tokenizer ---------------------------


def test_render_down_at_start_up_falls_back_to_the_local_tokenizer(bench: FaultBench) -> None:
    # The render breaker must stay open across both requests, the first of which loads the
    # local tokenizer (seconds on a busy machine): a cool-down far longer than that.
    gateway = bench.start(
        proxy_up=False, scheduler={"policy": "kv_cache_affinity"}, render_config={"breaker_cooldown_s": 120.0}
    )
    before = gateway.state()["tokenization"]
    assert before["local_tokenizer_loaded"] is False  # not loaded at start-up

    long_chat = {**CHAT, "messages": [{"role": "user", "content": "long prompt " * 40}]}
    response = bench.post(long_chat)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == NATIVE_TEXT
    streamed = bench.post({**long_chat, "stream": True})
    assert streamed.status_code == 200 and _sse_events(streamed.text)[-1] == "[DONE]"
    # Each fallback is a stage line with its cause, under the id the client got, and a count.
    causes = [
        [
            (s["stage"], s.get("cause"))
            for s in gateway.stages(r.headers["x-request-id"])
            if s["stage"].startswith("render")
        ]
        for r in (response, streamed)
    ]
    assert causes == [[("render.local_tokenizer", "unavailable")], [("render.local_tokenizer", "render_breaker_open")]]
    samples = gateway.metrics()
    assert metric(samples, "tito_render_fallbacks_total", cause="unavailable") == 1
    assert metric(samples, "tito_render_fallbacks_total", cause="render_breaker_open") == 1
    assert metric(samples, "tito_render_seconds_count", source="local_tokenizer") == 2

    state = gateway.assert_no_leaks()
    assert state["tokenization"]["local_tokenizer_loaded"] is True
    assert state["tokenization"]["fallbacks"] == {"unavailable": 1, "render_breaker_open": 1}
    assert state["scheduler"]["prefix_index_blocks"] > 0  # scheduled on the local token ids
    native = _native_calls(gateway)
    assert [orjson.loads(r.body) for r in native] == [long_chat, {**long_chat, "stream": True}]
    assert _generate_calls(gateway) == []  # never an incomplete token-only request


def test_render_killed_while_running(bench: FaultBench) -> None:
    gateway = bench.start()
    assert bench.post(CHAT).status_code == 200
    assert len(_generate_calls(gateway)) == 1 and gateway.state()["tokenization"]["local_tokenizer_loaded"] is False
    bench.proxy_server.stop()
    response = bench.post(STREAM)
    assert response.status_code == 200 and _sse_events(response.text)[-1] == "[DONE]"
    assert len(_native_calls(gateway)) == 1
    state = gateway.assert_no_leaks()
    assert state["tokenization"]["local_tokenizer_loaded"] is True


@pytest.mark.parametrize("fault", ["stall", "invalid_body"])
def test_render_timeout_and_invalid_body_fall_back(bench: FaultBench, fault: str) -> None:
    gateway = bench.start(render_config={"timeout_ms": 500})
    bench.proxy.faults.append(RenderFault("render", fault))
    response = bench.post(CHAT)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == NATIVE_TEXT
    state = gateway.assert_no_leaks()
    reason = "timeout" if fault == "stall" else "invalid_response"
    assert state["tokenization"]["fallbacks"] == {reason: 1}
    assert len(_native_calls(gateway)) == 1 and _generate_calls(gateway) == []


def test_render_400_reaches_the_client_unchanged(shared: FaultBench, stack: RunningStack) -> None:
    gateway = shared.started()
    bad = {**CHAT, "max_tokens": -1}
    direct = httpx.post(stack.config.render_config.endpoint.url + "/v1/chat/completions/render", json=bad, timeout=10)
    response = shared.post(bad)
    assert response.status_code == direct.status_code == 400
    assert response.json() == direct.json()
    state = gateway.assert_no_leaks()
    assert state["tokenization"]["fallbacks"] == {} and state["tokenization"]["local_tokenizer_loaded"] is False
    assert [r for sim in gateway.sims for r in sim.received] == []


def test_render_breaker_skips_render_then_probes(bench: FaultBench) -> None:
    cooldown = 10.0  # well above the first fallback's lazy tokenizer load (seconds on a busy machine)
    gateway = bench.start(render_config={"breaker_cooldown_s": cooldown})
    bench.proxy.faults.append(RenderFault("render", "status", status=503, times=1))
    failed_at = time.monotonic()
    assert bench.post(CHAT).status_code == 200  # the failure: fallback
    assert len(bench.proxy.calls_to("render")) == 1
    for _ in range(3):
        assert bench.post(CHAT).status_code == 200
    assert len(bench.proxy.calls_to("render")) == 1  # breaker open: render not called
    assert gateway.state()["tokenization"]["render_breaker"] == "open"
    time.sleep(max(0.0, failed_at + cooldown + 0.2 - time.monotonic()))
    assert bench.post(CHAT).status_code == 200
    assert len(bench.proxy.calls_to("render")) == 2  # one probe went through, and succeeded
    assert gateway.state()["tokenization"]["render_breaker"] == "closed"
    assert len(_generate_calls(gateway)) == 1  # the probe's request went token-only again
    gateway.assert_no_leaks()


# -- token-only engine capability ------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_engine_without_token_only_generate_is_served_natively_once(bench: FaultBench, stream: bool) -> None:
    gateway = bench.start()
    gateway.sims[0].fault = Fault("status", status=404)
    response = bench.post(STREAM if stream else CHAT)
    assert response.status_code == 200
    if stream:
        assert _sse_events(response.text)[-1] == "[DONE]" and NATIVE_TEXT in response.text
    else:
        assert response.json()["choices"][0]["message"]["content"] == NATIVE_TEXT
    assert len(_generate_calls(gateway)) == 1 and len(_native_calls(gateway)) == 1
    stages = gateway.stages(response.headers["x-request-id"], until="native_replay")
    assert [s["stage"] for s in stages] == ["generate", "native_replay"]
    assert metric(gateway.metrics(), "tito_native_replays_total") == 1
    # Remembered: the next request goes native directly.
    assert bench.post(CHAT).status_code == 200
    assert len(_generate_calls(gateway)) == 1 and len(_native_calls(gateway)) == 2
    state = gateway.assert_no_leaks()
    [instance] = state["scheduler"]["instances"].values()
    assert instance["token_only"] is False and instance["breaker"] == "closed"


# -- engine execution -------------------------------------------------------------------------


def test_engine_503_before_first_byte_is_retried_elsewhere(bench: FaultBench) -> None:
    gateway = bench.start(n_engines=2, scheduler={"policy": "round_robin"})
    gateway.sims[0].fault = Fault("status", status=503)
    before = metric(gateway.metrics(), "tito_engine_retries_total", instance=gateway.sims[0].address)
    responses = [bench.post(CHAT) for _ in range(2)]
    assert [r.json()["object"] for r in responses] == ["chat.completion"] * 2
    state = gateway.assert_no_leaks()
    failed = gateway.sims[0].address
    assert state["scheduler"]["instances"][failed]["consecutive_failures"] == 1
    assert metric(gateway.metrics(), "tito_engine_retries_total", instance=failed) == before + 1
    # The retried request's stage lines: its generate leg, then the retry to the other engine.
    retried = [
        [
            (s["stage"], s.get("failed"), s.get("served_by"))
            for s in gateway.stages(r.headers["x-request-id"], until="retry")
        ]
        for r in responses
    ]
    assert sorted(retried, key=len) == [
        [("generate", None, None)],
        [("generate", None, None), ("retry", failed, gateway.sims[1].address)],
    ]


def test_inband_engine_error_becomes_an_openai_error_event(bench: FaultBench) -> None:
    gateway = bench.start()
    gateway.sims[0].fault = Fault("inband_error", after_tokens=2)
    response = bench.post({**STREAM, "max_tokens": 10})
    assert response.status_code == 200
    events = _sse_events(response.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    error = orjson.loads(events[-2])["error"]  # the engine's own error object, as native streams it
    assert error == {
        "message": "simulated engine core failure",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
    stages = gateway.stages(response.headers["x-request-id"], until="stream.failure")
    assert [(s["stage"], s.get("code")) for s in stages][-1] == ("stream.failure", str(error["code"]))
    chunks = [orjson.loads(e) for e in events[:-2]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    # the role chunk, then the two tokens before the error (one chunk or two: text that
    # arrives together leaves together)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    assert 1 <= len(deltas) <= 2 and all(d.get("content") or d.get("reasoning") for d in deltas)
    gateway.assert_no_leaks()


def test_engine_dying_mid_stream_leaks_nothing(bench: FaultBench) -> None:
    gateway = bench.start()
    gateway.sims[0].fault = Fault("abort", after_tokens=3)
    gateway.sims[0].token_delay_s = 0.1  # the tokens before the abort reach the client first
    received = b""
    request = httpx.stream(
        "POST",
        gateway.base_url + "/v1/chat/completions",
        json={**STREAM, "max_tokens": 10},
        timeout=30,
        trust_env=False,
    )
    # The client sees a truncated stream, not a clean end.
    with pytest.raises(httpx.HTTPError), request as response:
        assert response.status_code == 200
        for chunk in response.iter_raw():
            received += chunk
    assert received.count(b"chat.completion.chunk") >= 2 and b"[DONE]" not in received
    gateway.assert_no_leaks()


def test_client_leaving_a_stalled_stream_leaks_nothing(bench: FaultBench) -> None:
    gateway = bench.start()
    gateway.sims[0].fault = Fault("stall", after_tokens=2)
    with httpx.stream(
        "POST",
        gateway.base_url + "/v1/chat/completions",
        json={**STREAM, "max_tokens": 10},
        timeout=30,
        trust_env=False,
    ) as response:
        seen = b""
        for chunk in response.iter_raw():
            seen += chunk
            if seen.count(b"chat.completion.chunk") == 2:
                break  # the engine stalls; the client gives up and disconnects
        request_id = response.headers["x-request-id"]
    gateway.assert_no_leaks()
    [cancelled] = [s for s in gateway.stages(request_id, until="cancelled") if s["stage"] == "cancelled"]
    assert cancelled["status"] == 200 and cancelled["level"] == "info"
    assert metric(gateway.metrics(), "tito_cancellations_total", api="chat") == 1


# -- Derender ------------------------------------------------------------------------------------

DERENDER_FAULTS = [
    (
        "status-422",
        RenderFault(
            "derender",
            "status",
            status=422,
            body=b'{"error":{"message":"bad state","type":"BadRequestError","param":null,"code":422}}',
        ),
        422,
        "derender_rejected",
    ),
    (
        "status-404",
        RenderFault("derender", "status", status=404, body=b'{"detail":"Not Found"}'),
        501,
        "derender_unsupported",
    ),
    ("timeout", RenderFault("derender", "stall"), 504, "derender_timeout"),
    ("status-503", RenderFault("derender", "status", status=503), 502, "derender_failed"),
]


@pytest.mark.parametrize(
    ("fault", "status", "code"), [f[1:] for f in DERENDER_FAULTS], ids=[f[0] for f in DERENDER_FAULTS]
)
@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_derender_failures_map_to_response_errors_without_reinference(
    sidecar: FaultBench, fault: RenderFault, status: int, code: str, stream: bool
) -> None:
    # the sidecar's /derender is what fails here (in-process derender makes no call)
    gateway = sidecar.started()
    sidecar.proxy.faults.append(RenderFault(fault.target, fault.kind, fault.status, fault.body, stream=stream))
    response = sidecar.post(STREAM if stream else CHAT)
    if stream:
        assert response.status_code == 200  # already streaming: the error ends the stream
        events = _sse_events(response.text)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        error = orjson.loads(events[-2])["error"]
    else:
        assert response.status_code == status
        error = response.json()["error"]
    assert error["code"] == code and error["message"]
    stages = gateway.stages(response.headers["x-request-id"], until="derender.failure")
    assert ("derender.failure", code) in [(s["stage"], s.get("code")) for s in stages]
    if fault.kind == "status" and fault.status == 422:
        assert "bad state" in error["message"]  # the detail is kept
    assert len(_generate_calls(gateway)) == 1  # never re-run
    state = gateway.assert_no_leaks()
    [instance] = state["scheduler"]["instances"].values()
    assert instance["breaker"] == "closed" and instance["consecutive_failures"] == 0  # not an engine failure


# -- request hygiene -------------------------------------------------------------------------


@pytest.mark.parametrize("mib", [6, 30])
def test_large_chat_bodies_go_through(shared: FaultBench, mib: int) -> None:
    gateway = shared.started()
    big = {**CHAT, "metadata": {"blob": "x" * (mib << 20)}}
    response = shared.post(big)
    assert response.status_code == 200 and response.json()["object"] == "chat.completion"
    assert len(_generate_calls(gateway)) == 1
    gateway.assert_no_leaks()


def test_a_body_over_the_limit_is_413_and_reaches_nothing(shared: FaultBench) -> None:
    gateway = shared.started()
    response = shared.post({**CHAT, "metadata": {"blob": "x" * (33 << 20)}})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert shared.proxy.calls == [] and [r for sim in gateway.sims for r in sim.received] == []
    gateway.assert_no_leaks()


@pytest.mark.parametrize(
    ("body", "headers", "status"),
    [
        (b'{"model": "tiny", "messages": [', {"content-type": "application/json"}, 400),
        (orjson.dumps({**CHAT, "model": "nope"}), {"content-type": "application/json"}, 404),
        (orjson.dumps(CHAT), {"content-type": "text/plain"}, 400),
    ],
    ids=["malformed", "unknown-model", "wrong-content-type"],
)
def test_bad_requests_touch_neither_render_nor_engines(
    shared: FaultBench, body: bytes, headers: dict[str, str], status: int
) -> None:
    gateway = shared.started()
    path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
    response = shared.post(body, path=path, headers=headers)
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert shared.proxy.calls == []
    assert [r for sim in gateway.sims for r in sim.received] == []
    gateway.assert_no_leaks()


def test_a_body_render_refuses_gets_its_answer_and_reaches_no_engine(shared: FaultBench) -> None:
    """Render validates with native's request models: its verdict is the client's answer."""
    gateway = shared.started()
    response = shared.post(orjson.dumps({"model": "tiny", "prompt": ""}), path="/v1/completions")
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("Either prompt or prompt_embeds must be provided")
    assert [r for sim in gateway.sims for r in sim.received] == []
    gateway.assert_no_leaks()
