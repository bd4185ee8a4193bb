"""The gateway's edge as a hostile client meets it: real Envoy + processor + the real render
sidecar over engine simulators. Only the OpenAI API is public, clients cannot steer engines
or breakers, memory and time are bounded, and every failure is a clean OpenAI error. Every
test also proves nothing was left behind (`/debug/state` back to zero)."""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from ext_proc.config_edge import DEFAULT_ROUTES
from tests.conftest import RunningStack, SimGateway, running_sim_gateway
from tests.engine_sim import Fault

MiB = 1 << 20
LIMIT = 32 * MiB  # the default listener.max_request_bytes, and the default in-flight budget
RESPONSE_CAP = 1 * MiB
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}


@pytest.fixture(scope="module")
def edge(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimGateway]:
    with running_sim_gateway(
        stack,
        tmp_path_factory.mktemp("edge"),
        2,
        processor={"max_response_bytes": RESPONSE_CAP},
        scheduler={"policy": "round_robin"},
        # an engine's own route passed through (the default table has none: /v1/models is the catalog's)
        listener={"routes": [*DEFAULT_ROUTES, {"method": "GET", "path": "/version", "handler": "passthrough"}]},
    ) as gateway:
        yield gateway


@pytest.fixture
def gw(edge: SimGateway) -> Iterator[SimGateway]:
    """The shared gateway with clean simulators, checked for leaks after each test."""
    edge.restore()
    yield edge
    edge.assert_no_leaks()
    state = edge.state()
    assert state["inflight_bytes"] == 0
    assert all(i["breaker"] == "closed" for i in state["scheduler"]["instances"].values())
    edge.restore()


def _raw(gateway: SimGateway, method: str, path: str, body: bytes = b"", **headers: str) -> tuple[int, bytes]:
    """A request sent exactly as written (no client-side path normalization)."""
    connection = http.client.HTTPConnection("127.0.0.1", gateway.config.listener.port, timeout=30)
    try:
        connection.putrequest(method, path, skip_accept_encoding=True)
        given = {name.replace("_", "-"): value for name, value in headers.items()}
        for name, value in {"content-type": "application/json", "content-length": str(len(body)), **given}.items():
            connection.putheader(name, value)
        connection.endheaders(body or None)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _error(body: bytes) -> dict[str, Any]:
    error: dict[str, Any] = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def _processor_rss(gateway: SimGateway) -> int:
    pid = gateway.gateway.processes["processor"].popen.pid  # type: ignore[union-attr]
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class PeakRss:
    """The processor's resident memory, sampled while a block runs."""

    def __init__(self, gateway: SimGateway) -> None:
        self.gateway = gateway
        self.baseline = self.peak = _processor_rss(gateway)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _processor_rss(self.gateway))

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.baseline


# -- only the OpenAI API is public ----------------------------------------------------------

ENGINE_ROUTES = [
    ("POST", "/inference/v1/generate", 404),
    ("POST", "/inference/v1/abort_requests", 404),
    ("POST", "/tokenize", 404),
    ("GET", "/metrics", 404),
    ("POST", "/v1/chat/completions/render", 404),
    ("POST", "/scale_elastic_ep", 404),
    ("POST", "/v1/chat/completions/", 404),
    ("GET", "/v1/chat/completions", 405),
    # normalized before the route table sees them
    ("POST", "/v1/models/../../inference/v1/generate", 404),
    ("GET", "/v1/models/%2e%2e/%2e%2e/metrics", 404),
    # escaped slashes cannot smuggle a path past the table
    ("POST", "/v1%2Fchat%2Fcompletions", 400),
]


@pytest.mark.parametrize(("method", "path", "status"), ENGINE_ROUTES)
def test_non_public_paths_get_an_openai_error_and_reach_nothing(
    gw: SimGateway, method: str, path: str, status: int
) -> None:
    generate = orjson.dumps({"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}})
    code, body = _raw(gw, method, path, generate if method == "POST" else b"")
    assert code == status
    assert _error(body)["type"] == "invalid_request_error"
    assert [r.path for sim in gw.sims for r in sim.received] == []


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/messages", 405),
        ("GET", "/v1/messages?beta=true", 405),
        ("GET", "/v1/messages/count_tokens", 405),
        ("POST", "/v1/messages/batches", 404),
    ],
)
def test_envoys_own_replies_under_anthropic_messages_are_in_its_envelope(
    gw: SimGateway, method: str, path: str, status: int
) -> None:
    code, body = _raw(gw, method, path, b"{}" if method == "POST" else b"")
    assert code == status
    error = orjson.loads(body)
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["message"]
    # an OpenAI route next to it keeps OpenAI's envelope
    code, body = _raw(gw, method, "/v1/messagesX" if method == "POST" else "/v1/responses")
    assert _error(body)["type"] == "invalid_request_error"


def test_paths_are_normalized_before_routing(gw: SimGateway) -> None:
    code, body = _raw(gw, "POST", "//v1//chat/./completions", orjson.dumps(CHAT))
    assert code == 200 and orjson.loads(body)["object"] == "chat.completion"


def test_health_is_answered_by_the_gateway(gw: SimGateway) -> None:
    assert _raw(gw, "GET", "/health") == (200, b'{"status":"ok"}')
    assert [r.path for sim in gw.sims for r in sim.received] == []


def test_passthrough_answers_arrive_whole(gw: SimGateway) -> None:
    """The engine's body reaches the client every time, not only its status. The call once
    ended as soon as the request was sent on, to spare Envoy's response messages; Envoy then
    dropped the body chunks it had already streamed to the processor (most answers, here)."""
    for _ in range(60):
        code, body = _raw(gw, "GET", "/version")
        assert (code, orjson.loads(body)) == (200, {"version": "0.32.0"})


def test_passthrough_failures_never_open_a_breaker(gw: SimGateway) -> None:
    """Ten 5xx on a passthrough route and three on an engine route: every breaker stays closed and chat works."""
    for sim in gw.sims:
        sim.fault = Fault("status", status=500)
    for _ in range(10):
        code, body = _raw(gw, "GET", "/version")
        assert code == 500 and _error(body)["message"] == "simulated engine failure 500"
    for _ in range(3):
        assert _raw(gw, "POST", "/scale_elastic_ep", b"{}")[0] == 404
    assert all(i["breaker"] == "closed" for i in gw.state()["scheduler"]["instances"].values())
    for sim in gw.sims:
        sim.fault = None
    assert _raw(gw, "POST", "/v1/chat/completions", orjson.dumps(CHAT))[0] == 200


# -- clients cannot steer engines -----------------------------------------------------------

STEERING = {
    "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.9.9.9"},
    "vllm_xargs": {"x": 1},
    "priority": -100,
    "cache_salt": "attacker-salt",
}
STEERING_HEADERS = {
    "x-data-parallel-rank": "1",
    "x-envoy-max-retries": "9",
    "x-envoy-retry-on": "5xx",
    "x-gateway-destination-endpoint": "10.9.9.9:80",
    "authorization": "Bearer client-secret",
}


def test_client_fields_and_headers_do_not_reach_engines(gw: SimGateway) -> None:
    response = httpx.post(
        gw.base_url + "/v1/chat/completions", json={**CHAT, **STEERING}, headers=STEERING_HEADERS, timeout=30
    )
    assert response.status_code == 200
    assert not [h for h in response.headers if h.startswith("x-envoy") or h.startswith("x-tito")]
    multi = {"model": "tiny", "prompt": ["one", "two"], "max_tokens": 3, **STEERING}  # the processor's own legs
    batch = httpx.post(gw.base_url + "/v1/completions", json=multi, headers=STEERING_HEADERS, timeout=30)
    assert batch.status_code == 200 and len(batch.json()["choices"]) == 2

    received = [r for sim in gw.sims for r in sim.received]
    assert [r.path for r in received] == ["/inference/v1/generate"] * 3
    for request in received:
        body = request.json()
        assert not set(body) & set(STEERING), request.path
        assert "extra_args" not in body.get("sampling_params", {})
        assert not set(request.headers) & set(STEERING_HEADERS), request.headers
        assert body.get("kv_transfer_params") is None


def test_out_of_range_token_ids_are_native_400s_before_any_work(gw: SimGateway) -> None:
    """Native's engine checks each prompt's lowest, then highest id (`validate_token_ids`);
    a negative id is refused before that by the request model (render, as native)."""
    for prompt, message in (
        ([4294967296, *range(1, 20)], "Token id 4294967296 is out of vocabulary"),
        ([[1, 2], [10**6, 3]], "Token id 1000000 is out of vocabulary"),
        ([-1, 2], "validation error"),
    ):
        response = httpx.post(
            gw.base_url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 3}, timeout=30
        )
        assert response.status_code == 400
        error = _error(response.content)
        assert message in error["message"] and error["code"] == 400, error
    assert [r.path for sim in gw.sims for r in sim.received] == []


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([[1, 2], [10**6, 3]], "Token id 1000000 is out of vocabulary"),
        (["", "x"], "The decoder prompt cannot be empty"),
        ([[]], "The decoder prompt cannot be empty"),
    ],
)
def test_what_natives_engine_finds_in_a_streams_prompts_is_its_error_event(
    gw: SimGateway, prompt: list[Any], message: str
) -> None:
    """Native's engine checks each prompt while generating: a streaming request gets 200, the
    error event and [DONE] (`completion_stream_generator`), and no engine is asked."""
    for stream in (True, "true"):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "stream": stream}
        response = httpx.post(gw.base_url + "/v1/completions", json=body, timeout=30)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [block.removeprefix("data: ") for block in response.text.split("\n\n") if block]
        assert len(events) == 2 and events[1] == "[DONE]", response.text
        error = orjson.loads(events[0])["error"]
        assert error == {"message": message, "type": "BadRequestError", "param": None, "code": 400}
        whole = httpx.post(gw.base_url + "/v1/completions", json={**body, "stream": False}, timeout=30)
        assert whole.status_code == 400 and _error(whole.content)["message"] == message
    assert [r.path for sim in gw.sims for r in sim.received] == []


def test_stream_as_a_string_is_read_as_render_reads_it(gw: SimGateway) -> None:
    """vLLM accepts `"stream": "true"`; the gateway streams it, as native serving does."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": "true"}
    response = httpx.post(gw.base_url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("data: [DONE]\n\n") and response.text.count("[DONE]") == 1


# -- bounded memory and time ----------------------------------------------------------------


def _endless_upload(gw: SimGateway, total: int = 200 * MiB) -> tuple[int, bytes, int, float]:
    """A chunked upload of `total` bytes: (status, body, bytes sent, seconds from crossing the
    limit to the answer)."""
    sent, crossed = 0, 0.0

    def chunks() -> Iterator[bytes]:
        nonlocal sent, crossed
        piece = b"x" * (256 * 1024)
        while sent < total:
            yield piece
            sent += len(piece)
            if not crossed and sent > LIMIT:
                crossed = time.monotonic()

    headers = {"content-type": "application/json"}
    try:
        response = httpx.post(gw.base_url + "/v1/chat/completions", content=chunks(), headers=headers, timeout=60)
        status, body = response.status_code, response.content
    except httpx.HTTPError as exc:  # the connection closed under the upload before a response was read
        status, body = 0, repr(exc).encode()
    return status, body, sent, time.monotonic() - crossed


def test_an_endless_upload_is_cut_off_at_the_limit(gw: SimGateway) -> None:
    status, body, sent, after_limit = _endless_upload(gw)
    print(f"\n413 after {sent / MiB:.1f} MiB sent, {after_limit * 1000:.0f} ms after crossing {LIMIT / MiB:.0f} MiB")
    assert status == 413 and _error(body)["code"] == "request_too_large"
    assert sent < 100 * MiB  # not read to the end (in flight meanwhile: socket buffers, gRPC windows)
    assert after_limit < 1.0
    code, body = _raw(gw, "POST", "/v1/chat/completions", b"", content_length=str(200 * MiB))
    assert code == 413  # a declared length over the limit: answered before a byte is read


def test_eight_endless_uploads_keep_the_processor_bounded(gw: SimGateway) -> None:
    with PeakRss(gw) as rss, ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: _endless_upload(gw), range(8)))
    print(f"\nprocessor RSS growth under 8 × 200 MiB uploads: {rss.growth / MiB:.1f} MiB (limit {LIMIT / MiB:.0f} MiB)")
    for status, body, sent, _ in results:
        assert status in (413, 503), body  # over the limit, or over the in-flight budget
        assert _error(body)["code"] in ("request_too_large", "overloaded")
        assert sent < 200 * MiB
    assert rss.growth <= 2 * LIMIT


def test_an_oversized_response_is_a_502_and_releases_everything(gw: SimGateway) -> None:
    for sim in gw.sims:
        sim.pad_bytes = 2 * RESPONSE_CAP
    with PeakRss(gw) as rss, ThreadPoolExecutor(8) as pool:
        responses = list(
            pool.map(lambda _: httpx.post(gw.base_url + "/v1/chat/completions", json=CHAT, timeout=60), range(8))
        )
    print(f"\nprocessor RSS growth under 8 oversized responses: {rss.growth / MiB:.1f} MiB")
    for response in responses:
        assert response.status_code == 502
        assert _error(response.content)["code"] == "engine_response_too_large"
    assert rss.growth <= 2 * LIMIT


def test_eight_large_requests_keep_the_processor_bounded(gw: SimGateway) -> None:
    """Eight 4 MiB bodies at once: what fits the in-flight budget is served, the rest is a 503."""
    big = orjson.dumps({**CHAT, "metadata": {"blob": "y" * (LIMIT // 8 - 64 * 1024)}})
    for sim in gw.sims:
        sim.ttft_s = 0.2
    with PeakRss(gw) as rss, ThreadPoolExecutor(8) as pool:
        responses = list(
            pool.map(
                lambda _: httpx.post(
                    gw.base_url + "/v1/chat/completions",
                    content=big,
                    headers={"content-type": "application/json"},
                    timeout=60,
                ),
                range(8),
            )
        )
    statuses = sorted(r.status_code for r in responses)
    print(f"\nprocessor RSS growth under 8 × {len(big) / MiB:.1f} MiB requests: {rss.growth / MiB:.1f} MiB, {statuses}")
    assert set(statuses) <= {200, 503} and 200 in statuses
    for response in responses:
        if response.status_code == 503:
            assert _error(response.content)["code"] == "overloaded"
    assert rss.growth <= 4 * LIMIT
    # the engines never saw the client's metadata
    assert all(b"blob" not in r.body for sim in gw.sims for r in sim.received)


# -- a failed stream also ends the engine's -------------------------------------------------


def test_a_failed_stream_also_ends_the_engine_stream(gw: SimGateway) -> None:
    for sim in gw.sims:
        sim.fault = Fault("garbage", after_tokens=3)
        sim.token_delay_s = 0.05
    body = {**CHAT, "max_tokens": 200, "stream": True}
    response = httpx.post(gw.base_url + "/v1/chat/completions", json=body, timeout=60)
    events = [e.removeprefix("data: ") for e in response.text.strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    assert _error(events[-2].encode())["code"] == "derender_failed"
    deadline = time.monotonic() + 5
    while sum(s.streams_cut for s in gw.sims) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sum(s.streams_cut for s in gw.sims) == 1  # long before its 200 tokens (10 s)


# -- admission charges what engines may generate ---------------------------------------------


def _admitted_while_in_flight(gw: SimGateway, path: str, body: dict[str, Any]) -> int:
    for sim in gw.sims:
        sim.ttft_s = 1.0
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(httpx.post, gw.base_url + path, json=body, timeout=30)
        deadline = time.monotonic() + 10
        admitted = 0
        while not admitted and time.monotonic() < deadline:
            admitted = gw.state()["scheduler"]["total_active_tokens"]
            time.sleep(0.02)
        assert done.result().status_code == 200
    return int(admitted)


def test_admission_charges_n_choices_and_every_prompt(gw: SimGateway, stack: RunningStack) -> None:
    render = stack.config.render_config.endpoint.url

    def prompt_tokens(api: str, body: dict[str, Any]) -> list[int]:
        rendered = httpx.post(f"{render}/v1/{api}/render", json=body, timeout=10).json()
        return [len(r["token_ids"]) for r in (rendered if isinstance(rendered, list) else [rendered])]

    chat = {**CHAT, "n": 3, "max_tokens": 7}
    [chat_prompt] = prompt_tokens("chat/completions", chat)
    assert _admitted_while_in_flight(gw, "/v1/chat/completions", chat) == chat_prompt + 3 * 7

    multi = {"model": "tiny", "prompt": ["one two three", "four"], "n": 2, "max_tokens": 5}
    lengths = prompt_tokens("completions", multi)
    assert len(lengths) == 2
    assert _admitted_while_in_flight(gw, "/v1/completions", multi) == sum(lengths) + 2 * 2 * 5
