"""Flow control and tenancy through real Envoy and processor over an engine simulator: API
keys (401/403 in each API's envelope, never a key in the log), a request that does not fit
waiting for room instead of a 429, a queue timeout answered 429 with Retry-After, a client
that leaves while queued removed at once, and tenants' tokens per minute shared by two
processor workers through a real Redis."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis import Redis

from tests.conftest import RunningStack, SimGateway, free_port, missing, running_sim_gateway
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
