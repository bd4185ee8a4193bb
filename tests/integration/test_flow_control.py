"""Flow control and tenancy through real Envoy and processor over an engine simulator: API
keys (401/403 in each API's envelope, never a key in the log), a request that does not fit
waiting for room instead of a 429, a queue timeout answered 429 with Retry-After, a client
that leaves while queued removed at once, a sheddable request in flight evicted for a higher
band (its client told, its engine stream cut), and tenants' tokens per minute shared by two
processor workers through a real Redis."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from redis import Redis

from tests.conftest import RunningStack, SimGateway, free_port, metric, missing, running_sim_gateway
from tests.redis_server import RedisServer
from tests.unit.test_tenancy import KEY_A, KEY_B, _keys_file

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "wait your turn"}], "max_tokens": 20}
BUDGET = 60  # tokens: one chat of 20 at a time (its prompt is about 15)
TPM = 400  # team b's tokens per minute, all workers together


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if not RedisServer.available():
        missing("redis-server")
    server = RedisServer(tmp_path_factory.mktemp("redis"), free_port()).start()
    yield server
    server.stop()


def _running(stack: RunningStack, redis: RedisServer, work: Path, workers: int) -> Iterator[SimGateway]:
    keys = _keys_file(
        work / "keys.yaml",
        {"name": "a", "models": ["tiny"], "keys": [KEY_A]},
        {"name": "b", "tokens_per_minute": TPM, "keys": [KEY_B]},
    )
    with running_sim_gateway(
        stack,
        work,
        1,
        admission={"global_token_budget": BUDGET * workers, "queue_timeout_s": 4.0},  # (each worker a share)
        tenancy={"keys_file": str(keys), "redis_url": redis.url},
        processor={"workers": workers},
    ) as gw:
        yield gw


@pytest.fixture(scope="module")
def gateway(stack: RunningStack, redis: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimGateway]:
    yield from _running(stack, redis, tmp_path_factory.mktemp("flow"), workers=1)


@pytest.fixture(scope="module")
def two_workers(
    stack: RunningStack, redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SimGateway]:
    yield from _running(stack, redis, tmp_path_factory.mktemp("flow2"), workers=2)


def _post(gw: SimGateway, key: str | None, path: str = "/v1/chat/completions", **body: object) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(gw.base_url + path, json={**CHAT, **body}, headers=headers, timeout=30, trust_env=False)


def test_keys_are_checked_in_each_apis_envelope_and_never_logged(gateway: SimGateway) -> None:
    gateway.restore()
    missing_key = _post(gateway, None)
    assert missing_key.status_code == 401
    assert (
        missing_key.json()["error"]["type"] == "invalid_request_error" and missing_key.json()["error"]["code"] is None
    )
    unknown = _post(gateway, "sk-not-a-key-at-all")
    assert unknown.status_code == 401 and unknown.json()["error"]["code"] == "invalid_api_key"
    messages = {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    anthropic = httpx.post(
        gateway.base_url + "/v1/messages", json=messages, headers={"x-api-key": "sk-nope"}, timeout=30, trust_env=False
    )
    assert anthropic.status_code == 401
    assert anthropic.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": anthropic.json()["error"]["message"]},
    }
    forbidden = _post(gateway, KEY_A, model="tiny-b")
    assert forbidden.status_code in (403, 404)  # (a model this gateway serves under another name: native's 404)
    assert _post(gateway, KEY_A).status_code == 200
    assert not gateway.sims[0].received[0].headers.get("authorization")  # never forwarded
    logs = "".join(p.log_path.read_text() for p in gateway.gateway.processes.values())
    assert KEY_A not in logs and "sk-nope" not in logs and "sk-not-a-key-at-all" not in logs


def test_a_request_that_does_not_fit_waits_for_room(gateway: SimGateway) -> None:
    gateway.restore()
    gateway.sims[0].token_delay_s = 0.05  # each chat holds the whole budget about 1 s
    answers: list[tuple[float, int]] = []

    def chat() -> None:
        started = time.monotonic()
        status = _post(gateway, KEY_A).status_code
        answers.append((time.monotonic() - started, status))

    threads = [threading.Thread(target=chat) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(status for _, status in answers) == [200, 200, 200]  # (without the queue: two 429s)
    assert max(took for took, _ in answers) > 2.0  # one after another
    gateway.assert_no_leaks()


def test_a_queue_timeout_is_429_with_retry_after(gateway: SimGateway) -> None:
    gateway.restore()
    gateway.sims[0].token_delay_s = 0.3  # 20 tokens: 6 s, past the 4 s queue timeout
    holder = threading.Thread(target=_post, args=(gateway, KEY_A))
    holder.start()
    time.sleep(0.5)
    refused = _post(gateway, KEY_A)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "4"
    assert refused.json()["error"]["code"] == "queue_timeout"
    holder.join()
    gateway.assert_no_leaks()


def test_a_client_leaving_while_queued_is_removed_at_once(gateway: SimGateway) -> None:
    gateway.restore()
    gateway.sims[0].token_delay_s = 0.1
    holder = threading.Thread(target=_post, args=(gateway, KEY_A))
    holder.start()
    time.sleep(0.3)
    with pytest.raises(httpx.ReadTimeout):  # it waits in the queue; the client gives up
        httpx.post(
            gateway.base_url + "/v1/chat/completions",
            json=CHAT,
            headers={"authorization": f"Bearer {KEY_A}"},
            timeout=0.5,
            trust_env=False,
        )
    deadline = time.monotonic() + 2
    while gateway.state()["flow"]["requests"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gateway.state()["flow"]["requests"] == 0  # (the other worker's queue is its own: empty too)
    holder.join()
    gateway.assert_no_leaks()
    assert len(gateway.sims[0].received) == 1  # the one that left never reached the engine


def test_a_tenants_tokens_per_minute_hold_across_workers(two_workers: SimGateway, redis: RedisServer) -> None:
    """Thirty small chats of team b over both workers: what Redis charged in each minute's
    window stays within the quota and reaches it to within one request."""
    gateway = two_workers
    # Quotas count in whole-minute windows: thirty chats split across a minute's end fit in two
    # windows and are all served. Start them where the minute has time left for all of them
    # (they take a few seconds).
    left = 60 - time.time() % 60
    if left < 15:
        time.sleep(left + 0.2)
    statuses = [_post(gateway, KEY_B, max_tokens=5).status_code for _ in range(30)]
    assert set(statuses) == {200, 429}
    refused = _post(gateway, KEY_B, max_tokens=5)
    assert refused.json()["error"]["code"] == "tenant_quota_exceeded" and int(refused.headers["retry-after"]) >= 1
    store = Redis.from_url(redis.url)
    charged = [int(store.get(key) or 0) for key in store.scan_iter("tito:tpm:b:*")]
    one_request = max(charged) // max(1, statuses.count(200))
    assert charged and all(c <= TPM for c in charged)
    assert max(charged) > TPM - 2 * one_request  # (30 requests could take three times the quota)
    store.close()


# -- eviction ---------------------------------------------------------------------------------

OBJECTIVES = {"batch": -1, "interactive": 10}


EVICTING = {
    "global_token_budget": BUDGET,
    "queue_timeout_s": 10.0,
    "flow_active_s": 0.5,  # (a band seen recently keeps room for itself: tests start apart)
    "objectives": OBJECTIVES,
    "evict_sheddable": True,
    "queue_max_requests": 1,  # (one waiting request fills it)
}


@pytest.fixture(scope="module")
def evicting(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimGateway]:
    with running_sim_gateway(stack, tmp_path_factory.mktemp("evict"), 1, admission=EVICTING) as gw:
        yield gw


@pytest.fixture(scope="module")
def evicting_owned(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimGateway]:
    """Streams run by the processor (relay on): an eviction ends them from the processor's writer."""
    work = tmp_path_factory.mktemp("evict_owned")
    with running_sim_gateway(stack, work, 1, admission=EVICTING, reschedule={"enable": True}) as gw:
        yield gw


def _objective(name: str) -> dict[str, str]:
    return {"x-llm-d-inference-objective": name, "x-llm-d-inference-fairness-id": name}


def _batch(gw: SimGateway, api: str, stream: bool, out: list[httpx.Response]) -> threading.Thread:
    """A sheddable request, answered in its own thread (its body read whole)."""
    path, body = "/v1/chat/completions", {**CHAT, "stream": stream}
    if api == "messages":
        path, body = "/v1/messages", {"model": "tiny", "max_tokens": 20, "stream": stream, "messages": CHAT["messages"]}
    elif api == "responses":
        path, body = "/v1/responses", {"model": "tiny", "max_output_tokens": 20, "stream": stream, "input": "wait"}

    def send() -> None:
        out.append(httpx.post(gw.base_url + path, json=body, headers=_objective("batch"), timeout=30, trust_env=False))

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def _evicted_by_an_interactive_chat(gw: SimGateway, api: str, stream: bool, ttft_s: float = 0.0) -> httpx.Response:
    """A batch request on the engine (the budget holds one), then an interactive chat: the
    batch request's answer, once the interactive one was served. `ttft_s`: the engine's
    response headers go at once, its first token that much later."""
    gw.restore()
    sim = gw.sims[0]
    sim.token_delay_s = 0.1  # 20 tokens: 2 s on the engine
    sim.ttft_s = ttft_s
    time.sleep(0.6)  # the last test's flows are no longer active
    sent, cut = len(sim.generate_requests()), sim.streams_cut
    out: list[httpx.Response] = []
    thread = _batch(gw, api, stream, out)
    deadline = time.monotonic() + 5
    while len(sim.generate_requests()) == sent and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.5)  # a few of its tokens reach the client
    urgent = httpx.post(
        gw.base_url + "/v1/chat/completions",
        json=CHAT,  # (both do not fit the budget)
        headers=_objective("interactive"),
        timeout=30,
        trust_env=False,
    )
    assert urgent.status_code == 200 and urgent.json()["choices"][0]["finish_reason"] == "length"
    thread.join(30)
    deadline = time.monotonic() + 5  # the engine is not left generating for nobody
    while stream and sim.streams_cut == cut and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sim.streams_cut == cut + stream  # (the simulator counts streams only)
    assert len(sim.generate_requests()) == sent + 2
    gw.assert_no_leaks()
    return out[0]


@pytest.mark.parametrize("path", ["evicting", "evicting_owned"], ids=["routed", "owned"])
def test_a_sheddable_stream_is_evicted_for_a_higher_band_and_told_so(path: str, request: pytest.FixtureRequest) -> None:
    evicting = request.getfixturevalue(path)
    before = metric(evicting.metrics(), "tito_flow_requests_total", band="-1", outcome="evicted")
    answer = _evicted_by_an_interactive_chat(evicting, "chat", stream=True)
    assert answer.status_code == 200
    events = [e.removeprefix("data: ") for e in answer.text.split("\n\n") if e]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert orjson.loads(events[-2])["error"] == {
        "message": "request evicted by flow control",
        "type": "rate_limit_error",
        "param": None,
        "code": "evicted",
    }
    assert orjson.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"  # it had started
    after = metric(evicting.metrics(), "tito_flow_requests_total", band="-1", outcome="evicted")
    assert after == before + 1 and evicting.state()["flow"]["evicted"] >= 1


@pytest.mark.parametrize("path", ["evicting", "evicting_owned"], ids=["routed", "owned"])
def test_a_stream_evicted_before_its_first_token_still_ends_with_the_notice(
    path: str, request: pytest.FixtureRequest
) -> None:
    """The client has the engine's headers, the engine no token yet: Envoy would reset the
    client's stream on a body reply before it streams any body, so the notice waits for it."""
    answer = _evicted_by_an_interactive_chat(request.getfixturevalue(path), "chat", stream=True, ttft_s=2.0)
    assert answer.status_code == 200
    events = [e.removeprefix("data: ") for e in answer.text.split("\n\n") if e]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert orjson.loads(events[-2])["error"]["code"] == "evicted"


def test_a_full_queue_refuses_from_the_headers_without_reading_the_body(evicting: SimGateway) -> None:
    """A request the full queue turns away whatever its size is refused before its body is
    read (a body that is not even JSON gets the queue's 429, not a 400) and never rendered."""
    evicting.restore()
    sim = evicting.sims[0]
    sim.token_delay_s = 0.1  # 20 tokens: 2 s on the engine
    time.sleep(0.6)  # the last test's flows are no longer active
    before = metric(evicting.metrics(), "tito_flow_requests_total", band="-1", outcome="rejected_queue_full")
    out: list[httpx.Response] = []
    running = _batch(evicting, "chat", False, out)
    deadline = time.monotonic() + 5
    while not sim.generate_requests() and time.monotonic() < deadline:
        time.sleep(0.02)
    waiting = _batch(evicting, "chat", False, out)
    while evicting.state()["flow"]["requests"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    refused = httpx.post(
        evicting.base_url + "/v1/chat/completions",
        content=b"{not json",
        headers={**_objective("batch"), "content-type": "application/json"},
        timeout=30,
        trust_env=False,
    )
    assert refused.status_code == 429 and refused.headers["retry-after"] == "10"
    assert refused.json()["error"]["code"] == "queue_full"
    after = metric(evicting.metrics(), "tito_flow_requests_total", band="-1", outcome="rejected_queue_full")
    assert after == before + 1
    running.join(30)
    waiting.join(30)
    assert [r.status_code for r in out] == [200, 200]
    evicting.assert_no_leaks()


def test_an_answer_not_yet_started_is_evicted_as_a_429_with_retry_after(evicting: SimGateway) -> None:
    answer = _evicted_by_an_interactive_chat(evicting, "chat", stream=False)
    assert answer.status_code == 429 and answer.headers["retry-after"] == "10"
    assert answer.json()["error"]["code"] == "evicted"


EVICTION_EVENTS = {  # each API's own error event, the stream's last
    "messages": {"type": "error", "error": {"type": "rate_limit_error", "message": "request evicted by flow control"}},
    "responses": {"type": "error", "code": "evicted", "message": "request evicted by flow control", "param": None},
}


@pytest.mark.parametrize("api", ["messages", "responses"])
@pytest.mark.parametrize("path", ["evicting", "evicting_owned"], ids=["routed", "owned"])
def test_an_evicted_stream_ends_with_its_apis_error_event(path: str, api: str, request: pytest.FixtureRequest) -> None:
    answer = _evicted_by_an_interactive_chat(request.getfixturevalue(path), api, stream=True)
    assert answer.status_code == 200
    last = answer.text.strip().split("\n\n")[-1].split("\n")
    assert last[0] == "event: error"
    event = orjson.loads(last[1].removeprefix("data: "))
    event.pop("sequence_number", None)  # (Responses numbers its events)
    assert event == EVICTION_EVENTS[api]
