"""The render pool on scripted endpoints: balancing, retry, per-endpoint breakers, rejoin by a
tiny real render, the slow-endpoint warning, and what the caller sees when none can render."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import orjson
import pytest

from ext_proc.frontend.render import RenderRejected, RenderUnavailable
from ext_proc.frontend.render_pool import LATENCY_STALE_S, RenderPool, pool_member
from ext_proc.protocol import OpenAIRequest, Pipeline, PromptTokens, TokenizedRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class Scripted:
    """An endpoint: each render waits `delay_s`, then fails with `fail` (a reason) if set."""

    delay_s: float = 0.0
    fail: str | None = None
    reject: bool = False
    calls: list[str] = field(default_factory=list)

    async def render(self, request: OpenAIRequest, raw: bytes, request_id: str) -> TokenizedRequest:
        self.calls.append(request_id)
        await asyncio.sleep(self.delay_s)
        if self.reject:
            raise RenderRejected(400, "bad request")
        if self.fail is not None:
            raise RenderUnavailable(self.fail, "scripted")
        return TokenizedRequest(request, request_id, [PromptTokens([1, 2, 3])])

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _pool(*endpoints: Scripted, clock: Clock | None = None, budget_ms: float = 1000.0) -> RenderPool:
    members = [pool_member(f"r{i}:1", f"http://r{i}:1", e, cooldown_s=5.0) for i, e in enumerate(endpoints)]
    return RenderPool(members, "m", budget_ms, clock=clock or Clock())


def _render(pool: RenderPool, request_id: str = "r", body: dict[str, object] = CHAT) -> TokenizedRequest:
    return asyncio.run(pool.render(OpenAIRequest(Pipeline.CHAT, body), orjson.dumps(body), request_id))


def test_concurrent_renders_spread_over_idle_endpoints() -> None:
    a, b = Scripted(delay_s=0.02), Scripted(delay_s=0.02)
    pool = _pool(a, b)

    async def eight() -> None:
        body = orjson.dumps(CHAT)
        await asyncio.gather(*(pool.render(OpenAIRequest(Pipeline.CHAT, CHAT), body, f"r{i}") for i in range(8)))

    asyncio.run(eight())
    assert (len(a.calls), len(b.calls)) == (4, 4)
    assert all(m.in_flight == 0 and m.outstanding_bytes == 0 for m in pool.members)


def test_endpoints_of_about_the_same_speed_take_turns_one_request_at_a_time() -> None:
    a, b = Scripted(delay_s=0.004), Scripted(delay_s=0.006)  # noise, not a slow endpoint
    pool = _pool(a, b)
    for i in range(10):
        _render(pool, f"r{i}")
    assert (len(a.calls), len(b.calls)) == (5, 5)


def test_a_slower_endpoint_gets_less_traffic_and_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    fast, slow = Scripted(delay_s=0.002), Scripted(delay_s=0.05)
    pool = _pool(fast, slow, budget_ms=20)

    async def load() -> None:
        body = orjson.dumps(CHAT)
        for wave in range(6):
            await asyncio.gather(
                *(pool.render(OpenAIRequest(Pipeline.CHAT, CHAT), body, f"w{wave}-{i}") for i in range(4))
            )

    with caplog.at_level(logging.WARNING, "tito.render"):
        asyncio.run(load())
    assert len(fast.calls) > 2 * len(slow.calls) >= 2  # both used, the fast one most
    assert [r.message for r in caplog.records if "is slow" in r.message and "r1:1" in r.message]
    assert not [r for r in caplog.records if "is slow" in r.message and "r0:1" in r.message]
    assert pool.snapshot()["r1:1"]["p99_ms"] >= 50


@pytest.mark.parametrize("reason", ["unavailable", "timeout"])
def test_a_failed_endpoint_is_retried_on_another_and_skipped_until_it_renders_again(reason: str) -> None:
    clock = Clock()
    a, b = Scripted(fail=reason), Scripted()
    pool = _pool(a, b, clock=clock)
    pool._turn = 0  # the first request tries `a` first (both idle and unmeasured)
    assert _render(pool, "first").request_id == "first"
    assert (a.calls, b.calls) == (["first"], ["first"])
    assert pool.snapshot()["r0:1"]["breaker"] == "open"
    assert pool.snapshot()["r0:1"]["outcomes"] == {reason: 1, "retried": 1}
    for i in range(3):
        _render(pool, f"next{i}")
    assert len(a.calls) == 1  # skipped while its breaker is open
    assert pool.state() == "closed"  # the pool still renders

    a.fail = None
    clock.now += 5.1  # cool-down over: the health loop's tiny render lets it rejoin
    assert asyncio.run(pool.probe(pool.members[0])) is True
    assert a.calls[-1] == "tito-render-health"
    assert pool.snapshot()["r0:1"]["breaker"] == "closed"


def test_an_endpoint_that_rejoins_takes_its_turns_again_whatever_it_measured_before() -> None:
    """Its last renders before it failed were slow (it was dying): once a probe lets it back in,
    it counts as a new endpoint, not as the slow one it was."""
    clock = Clock()
    a, b = Scripted(delay_s=0.005), Scripted(delay_s=0.1)
    pool = _pool(a, b, clock=clock)
    pool._turn = 1
    _render(pool, "slow")  # b's last render before it dies: 100 ms, where a takes 5
    b.fail = "unavailable"
    pool._turn = 1
    _render(pool, "dies")
    assert pool.snapshot()["r1:1"]["breaker"] == "open"
    b.fail, b.delay_s = None, 0.005
    clock.now += 5.1
    assert asyncio.run(pool.probe(pool.members[1])) is True
    b.calls.clear()
    for i in range(6):
        _render(pool, f"after{i}")
    assert len(b.calls) >= 2  # its turns (3 of 6 when both take the same time)


def test_an_endpoint_slow_once_takes_its_turns_again_once_that_is_stale() -> None:
    """One slow render (a cold start, a pause) keeps an endpoint out of the turns only while
    that measure is recent: after `LATENCY_STALE_S` it counts as an average endpoint again."""
    clock = Clock()
    a, b = Scripted(delay_s=0.002), Scripted(delay_s=0.1)
    pool = _pool(a, b, clock=clock)
    pool._turn = 1
    _render(pool, "slow")  # b: 100 ms once, where a takes 2
    b.delay_s = 0.002
    b.calls.clear()
    for i in range(4):
        _render(pool, f"recent{i}")
    assert b.calls == []  # its one measure is recent: a is the faster one by far
    clock.now += LATENCY_STALE_S + 0.1
    for i in range(6):
        _render(pool, f"later{i}")
    assert len(b.calls) >= 2  # its turns again (3 of 6 when both take the same time)


def test_a_rejected_request_is_not_retried_and_counts_no_failure() -> None:
    a, b = Scripted(reject=True), Scripted(reject=True)
    pool = _pool(a, b)
    with pytest.raises(RenderRejected):
        _render(pool)
    assert len(a.calls) + len(b.calls) == 1
    assert {m["breaker"] for m in pool.snapshot().values()} == {"closed"}


def test_unsupported_is_not_retried() -> None:
    a, b = Scripted(fail="unsupported"), Scripted(fail="unsupported")
    with pytest.raises(RenderUnavailable, match="unsupported"):
        _render(_pool(a, b))
    assert len(a.calls) + len(b.calls) == 1


def test_with_every_endpoint_down_the_caller_is_told_why() -> None:
    clock = Clock()
    a, b = Scripted(fail="unavailable"), Scripted(fail="unavailable")
    pool = _pool(a, b, clock=clock)
    with pytest.raises(RenderUnavailable) as first:
        _render(pool)
    assert first.value.reason == "unavailable"  # one try and one retry, both failed
    assert (len(a.calls), len(b.calls)) == (1, 1)
    with pytest.raises(RenderUnavailable) as second:
        _render(pool)
    assert second.value.reason == "render_breaker_open" and pool.state() == "open"
    clock.now += 5.1  # cool-down over: a client request may probe, as with one endpoint
    a.fail = None
    assert pool.state() == "half_open"
    _render(pool, "probe")
    assert pool.state() == "closed"


def test_a_held_out_endpoint_is_not_used() -> None:
    a, b = Scripted(), Scripted()
    pool = _pool(a, b)
    pool.hold_out("r0:1", True)
    for i in range(3):
        _render(pool, f"r{i}")
    assert (len(a.calls), len(b.calls)) == (0, 3)
    pool.hold_out("r1:1", True)
    with pytest.raises(RenderUnavailable) as held:
        _render(pool)
    assert held.value.reason == "render_canary_mismatch"


def test_a_cancelled_render_leaves_nothing_behind() -> None:
    a = Scripted(delay_s=10)
    pool = _pool(a)

    async def cancel() -> None:
        task = asyncio.create_task(pool.render(OpenAIRequest(Pipeline.CHAT, CHAT), orjson.dumps(CHAT), "gone"))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel())
    snapshot = pool.snapshot()["r0:1"]
    assert (snapshot["in_flight"], snapshot["outstanding_bytes"], snapshot["breaker"]) == (0, 0, "closed")
    assert snapshot["outcomes"] == {"abandoned": 1}
