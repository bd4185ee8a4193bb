"""Token quotas through a real Redis: workers share one count, an outage falls back to each
process's share (or refuses, as configured) and ends on its own when Redis returns. No stack:
the quotas are called directly, on a fake clock that fixes the minute window."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import redis.asyncio as aioredis

from ext_proc.config_tenancy import TenancyConfig
from ext_proc.tenancy.quota import QuotaUnavailable, TokenQuota
from tests.conftest import free_port
from tests.redis_server import RedisServer, closing

WINDOW = 60 * 28_000_000  # a window's start
START = WINDOW + 15.0  # 45 s left in the window


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def quota(url: str | None, fail_mode: str = "local", processes: int = 2, timeout_s: float = 0.25) -> TokenQuota:
    config = TenancyConfig.model_validate(
        {"redis_url": url, "redis_fail_mode": fail_mode, "redis_timeout_s": timeout_s}
    )
    return TokenQuota(config, processes=processes, clock=Clock(START))


async def redis_value(server: RedisServer, key: str) -> bytes | str | None:
    client = aioredis.Redis.from_url(server.url)
    try:
        value: bytes | str | None = await client.get(key)
        return value
    finally:
        await client.aclose()


async def test_two_workers_share_one_count_in_redis(redis_server: RedisServer) -> None:
    clock = Clock(START)
    config = TenancyConfig(redis_url=redis_server.url)
    workers = [TokenQuota(config, processes=2, clock=clock) for _ in range(2)]
    async with closing(*workers):
        answers = [await workers[i % 2].reserve("acme", 100, 1000) for i in range(20)]
        assert answers.count(None) == 10  # the whole quota, not each worker's half
        assert [a for a in answers if a is not None] == [45.0] * 10
        assert await redis_value(redis_server, f"tito:tpm:acme:{WINDOW}") == b"1000"
        assert await workers[0].reserve("other", 100, 1000) is None  # tenants count apart

        clock.now = START + 60
        assert await workers[1].reserve("acme", 100, 1000) is None
        assert workers[0].snapshot() == {
            "backend": "redis",
            "redis_up": True,
            "store_errors": 0,
            "fallbacks": 0,
            "refused": 0,
        }


async def test_without_redis_each_process_enforces_its_share() -> None:
    local = quota(None, processes=2)
    async with closing(local):
        answers = [await local.reserve("acme", 100, 1000) for _ in range(7)]
        assert answers == [None] * 5 + [45.0] * 2
        assert local.snapshot()["backend"] == "local"
        assert local.snapshot()["redis_up"] is None


async def test_redis_outage_falls_back_to_the_local_share_then_recovers(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tito.quota")
    worker = quota(redis_server.url, "local", processes=2)
    async with closing(worker):
        assert [await worker.reserve("acme", 100, 1000) for _ in range(3)] == [None] * 3

        redis_server.stop()
        answers = [await worker.reserve("acme", 100, 1000) for _ in range(6)]
        assert answers == [None] * 5 + [45.0]  # this process's share: 500
        snapshot = worker.snapshot()
        assert snapshot["redis_up"] is False
        assert snapshot["store_errors"] == 1  # tried once, not on every call within the second
        assert snapshot["fallbacks"] == 6

        redis_server.start()
        await asyncio.sleep(1.1)
        assert await worker.reserve("acme", 100, 1000) is None
        assert worker.snapshot()["redis_up"] is True
        assert await redis_value(redis_server, f"tito:tpm:acme:{WINDOW}") == b"100"  # a fresh Redis
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings  # one per transition
    assert "unreachable" in warnings[0] and "each process enforces its share" in warnings[0]
    assert "reachable again" in warnings[1]
    assert f"127.0.0.1:{redis_server.port}" in warnings[0]


async def test_refuse_mode_raises_while_redis_is_down(redis_server: RedisServer) -> None:
    worker = quota(redis_server.url, "refuse")
    async with closing(worker):
        assert await worker.reserve("acme", 100, 1000) is None
        redis_server.stop()
        for _ in range(2):  # the first tries Redis, the second does not wait for it
            with pytest.raises(QuotaUnavailable):
                await worker.reserve("acme", 100, 1000)
        assert worker.snapshot()["refused"] == 2
        assert worker.snapshot()["store_errors"] == 1

        redis_server.start()
        await asyncio.sleep(1.1)
        assert await worker.reserve("acme", 100, 1000) is None
        assert worker.snapshot()["redis_up"] is True


@pytest.mark.parametrize("backend", ["redis", "local"])
async def test_a_request_larger_than_the_quota_is_never_granted(backend: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("redis_server").url if backend == "redis" else None
    worker = quota(url, processes=1)
    async with closing(worker):
        assert await worker.reserve("acme", 1001, 1000) == 45.0
        assert await worker.reserve("acme", 1000, 1000) is None  # the refusal charged nothing


async def test_the_password_is_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    port = free_port()  # nothing listens there
    worker = quota(f"redis://:pw-s3cr3t-4711@127.0.0.1:{port}/0")
    async with closing(worker):
        assert await worker.reserve("acme", 100, 1000) is None
    assert f"127.0.0.1:{port} unreachable" in caplog.text  # the warning was logged, without it
    assert "pw-s3cr3t-4711" not in caplog.text


async def test_a_redis_that_never_answers_costs_one_timeout() -> None:
    held: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # accepted, never answered

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    worker = quota(f"redis://127.0.0.1:{port}/0", timeout_s=0.2)
    async with closing(worker), server:
        began = time.monotonic()
        assert await worker.reserve("acme", 100, 1000) is None  # the local share
        assert time.monotonic() - began < 0.6
        began = time.monotonic()
        assert await worker.reserve("acme", 100, 1000) is None
        assert time.monotonic() - began < 0.05  # down: not tried again within the second
        assert worker.snapshot()["store_errors"] == 1
        for writer in held:
            writer.close()
