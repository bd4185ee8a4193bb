"""Flow control: who is admitted next (`scheduler.FlowQueue`: priority bands, fair share in
tokens, bounds, shedding) and the waiting room around it (`planning/flow_control.py`:
timeouts with Retry-After, clients leaving, room freed by releases)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from ext_proc.config_routing import AdmissionConfig
from ext_proc.errors import GatewayError
from ext_proc.planning.flow_control import BUDGET_FULL, FlowControl, QueueRefusal
from ext_proc.planning.plan import Local, Plan
from ext_proc.protocol import Flow
from ext_proc.response_handlers import Chunk, StreamResponse
from scheduler import FlowQueue, Waiting


def _drain(queue: FlowQueue) -> list[str]:
    order = []
    while (waiting := queue.next()) is not None:
        queue.dispatched(waiting)
        order.append(waiting.flow)
    return order


def test_the_highest_band_goes_first_then_arrival_order_within_a_flow() -> None:
    queue = FlowQueue(100)
    low, high, first, second = Waiting("a", -1, 10), Waiting("b", 5, 10), Waiting("c", 0, 10), Waiting("c", 0, 10)
    for waiting in (low, first, high, second):
        queue.push(waiting)
    order = []
    while (waiting := queue.next()) is not None:
        order.append(waiting)
        queue.dispatched(waiting)
    assert order == [high, first, second, low]


def test_equal_flows_share_by_tokens_whatever_they_queued() -> None:
    queue = FlowQueue(100)
    for _ in range(10):
        queue.push(Waiting("noisy", 0, 100))
    for _ in range(3):
        queue.push(Waiting("quiet", 0, 100))
    assert _drain(queue)[:6] == ["noisy", "quiet"] * 3  # (a FIFO would serve 10 noisy first)


def test_shares_follow_weights_and_tokens() -> None:
    queue = FlowQueue(100)
    for _ in range(8):
        queue.push(Waiting("heavy", 0, 100, weight=2.0))
        queue.push(Waiting("light", 0, 100))
    assert _drain(queue)[:6].count("heavy") == 4
    small = FlowQueue(100)
    for _ in range(6):
        small.push(Waiting("big", 0, 300))
        small.push(Waiting("small", 0, 100))
    assert _drain(small)[:4] == ["big", "small", "small", "small"]  # one 300-token request = three of 100


def test_an_idle_flow_banks_no_credit() -> None:
    queue = FlowQueue(100)
    for _ in range(5):
        queue.push(Waiting("busy", 0, 100))
    _drain(queue)  # busy alone: its virtual time is far ahead, the band's clock with it
    for _ in range(3):
        queue.push(Waiting("busy", 0, 100))
        queue.push(Waiting("new", 0, 100))
    assert _drain(queue)[:4] in (["busy", "new"] * 2, ["new", "busy"] * 2)


def test_a_full_queue_sheds_sheddable_waiters_lowest_and_newest_first() -> None:
    queue = FlowQueue(3, max_tokens=1000)
    old, new, other = Waiting("s", -1, 10), Waiting("s", -1, 10), Waiting("s", -2, 10)
    for waiting in (old, new, other):
        queue.push(waiting)
    assert queue.room_for(Waiting("x", 0, 10)) == [other]
    assert queue.room_for(Waiting("x", -1, 10)) == [other]  # only lower bands than the newcomer's
    assert queue.room_for(Waiting("x", -2, 10)) is None  # nothing lower: refused
    queue.remove(other)
    assert queue.room_for(Waiting("x", 0, 995)) == [new, old]  # tokens bound too
    assert queue.room_for(Waiting("x", 0, 2000)) is None


class Budget:
    """Admission's room, as a place() closure sees it: tokens left, and what was placed."""

    def __init__(self, tokens: int) -> None:
        self.left = tokens
        self.placed: list[str] = []
        self.given_back: list[Plan] = []

    def place(self, name: str, demand: int) -> Callable[[], Plan]:
        def attempt() -> Plan:
            if demand > self.left:
                raise GatewayError(429, "full", code=BUDGET_FULL)
            self.left -= demand
            self.placed.append(name)
            return Local(200, name.encode())

        return attempt


def _control(budget: Budget, timeout_s: float = 5.0, saturated: bool = False, **queue: int) -> FlowControl:
    config = AdmissionConfig(queue_timeout_s=timeout_s, **queue)
    return FlowControl(config, lambda: saturated, budget.given_back.append)


def _sharing(budget: Budget, tokens: int) -> FlowControl:
    """Flow control holding each active flow to its share of a `tokens` budget; a plan's
    lease is its name (Local(200, name))."""
    config = AdmissionConfig(queue_timeout_s=5, flow_active_s=5)
    return FlowControl(
        config, lambda: False, budget.given_back.append, budget=lambda: tokens, lease=lambda plan: plan.body.decode()
    )


async def test_off_a_request_that_does_not_fit_is_refused_at_once() -> None:
    budget = Budget(10)
    control = _control(budget, timeout_s=0)
    with pytest.raises(GatewayError) as refused:
        await control.admitted(Flow(), 20, budget.place("a", 20))
    assert refused.value.status == 429 and refused.value.code == BUDGET_FULL


async def test_waiters_are_placed_as_room_frees_in_fair_order() -> None:
    budget = Budget(100)
    control = _control(budget)
    assert await control.admitted(Flow("noisy"), 100, budget.place("n0", 100))
    waiters = [asyncio.create_task(control.admitted(Flow("noisy"), 100, budget.place(f"n{i}", 100))) for i in (1, 2)]
    await asyncio.sleep(0)
    waiters.append(asyncio.create_task(control.admitted(Flow("quiet"), 100, budget.place("q1", 100))))
    await asyncio.sleep(0.01)
    assert budget.placed == ["n0"] and control.snapshot()["requests"] == 3
    for _ in range(3):
        budget.left += 100  # a lease released
        control.released("lease")
        await asyncio.sleep(0.01)
    await asyncio.gather(*waiters)
    assert budget.placed == ["n0", "n1", "q1", "n2"]  # the quiet flow's one before noisy's second
    assert control.snapshot()["requests"] == 0


async def test_a_request_that_waits_its_whole_timeout_gets_429_with_retry_after() -> None:
    budget = Budget(0)
    control = _control(budget, timeout_s=0.1)
    with pytest.raises(QueueRefusal) as refused:
        await control.admitted(Flow(), 10, budget.place("a", 10))
    assert refused.value.status == 429 and refused.value.retry_after == 1 and refused.value.code == "queue_timeout"
    assert control.snapshot()["requests"] == 0 and control.timed_out == 1


async def test_a_client_leaving_while_queued_is_removed_at_once() -> None:
    budget = Budget(0)
    control = _control(budget)
    waiter = asyncio.create_task(control.admitted(Flow(), 10, budget.place("a", 10)))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert control.snapshot()["requests"] == 0
    budget.left = 10
    control.released("lease")
    await asyncio.sleep(0.01)
    assert budget.placed == []  # nothing placed for a client that is gone


async def test_a_plan_placed_as_its_client_leaves_gives_its_tokens_back() -> None:
    budget = Budget(0)
    control = _control(budget)
    waiter = asyncio.create_task(control.admitted(Flow(), 10, budget.place("a", 10)))
    await asyncio.sleep(0.01)
    budget.left = 10
    control._dispatch()  # placed now, and the client leaves before its task resumes
    waiter.cancel()
    try:  # either the request goes on with its plan (its stream then gives it back) ...
        assert await waiter == Local(200, b"a")
        assert budget.given_back == []
    except asyncio.CancelledError:  # ... or its tokens go back here: never neither
        assert budget.given_back == [Local(200, b"a")]
    assert budget.placed == ["a"]


async def test_when_full_sheddable_waiters_are_shed_for_a_higher_band() -> None:
    budget = Budget(0)
    control = _control(budget, queue_max_requests=1)
    sheddable = asyncio.create_task(control.admitted(Flow("batch", priority=-1), 10, budget.place("s", 10)))
    await asyncio.sleep(0.01)
    urgent = asyncio.create_task(control.admitted(Flow("chat", priority=1), 10, budget.place("u", 10)))
    with pytest.raises(QueueRefusal) as shed:
        await sheddable
    assert shed.value.code == "shed" and shed.value.retry_after >= 1
    with pytest.raises(QueueRefusal) as full:  # a third, of the same band: no room, nothing lower
        await control.admitted(Flow("chat", priority=1), 10, budget.place("x", 10))
    assert full.value.code == "queue_full"
    budget.left = 10
    control.released("lease")
    assert await urgent == Local(200, b"u")


async def test_a_request_the_full_queue_would_refuse_whatever_its_size_is_known_from_its_flow() -> None:
    """What the gateway refuses from the request's headers, before reading and rendering it."""
    budget = Budget(0)
    control = _control(budget, queue_max_requests=1)
    assert not control.full_for(Flow("batch", priority=-1))  # nothing waits
    waiter = asyncio.create_task(control.admitted(Flow("batch", priority=-1), 10, budget.place("s", 10)))
    await asyncio.sleep(0.01)
    assert control.full_for(Flow("batch", priority=-1)) and control.full_for(Flow("more", priority=-1))
    assert not control.full_for(Flow("chat"))  # a higher band sheds the sheddable waiter
    outcomes: list[tuple[str, str]] = []
    control.on_outcome = lambda band, outcome, waited: outcomes.append((band, outcome))
    refused = control.refused_full(-1)
    assert (refused.status, refused.code, refused.retry_after) == (429, "queue_full", 5)
    assert outcomes == [("-1", "rejected_queue_full")]
    assert not _control(Budget(0), timeout_s=0).full_for(Flow())  # flow control off
    waiter.cancel()


async def test_saturated_engines_queue_requests_the_budget_would_take() -> None:
    budget = Budget(100)
    saturated = [True]
    control = FlowControl(AdmissionConfig(queue_timeout_s=5), lambda: saturated[0], budget.given_back.append)
    waiter = asyncio.create_task(control.admitted(Flow(), 10, budget.place("a", 10)))
    await asyncio.sleep(0.12)
    assert budget.placed == []
    saturated[0] = False  # the engines' metrics say so: the tick lets it in, no release needed
    assert await waiter == Local(200, b"a")


async def test_a_flood_holds_at_most_its_share_while_another_flow_is_active() -> None:
    budget = Budget(100)
    control = _sharing(budget, 100)
    await control.admitted(Flow("quiet"), 20, budget.place("q0", 20))
    budget.left += 20
    control.released("q0")  # quiet is idle now, but was seen: still active
    noisy = [asyncio.create_task(control.admitted(Flow("noisy"), 20, budget.place(f"n{i}", 20))) for i in range(4)]
    await asyncio.sleep(0.01)
    assert budget.placed == ["q0", "n0", "n1"] and budget.left == 60  # half the budget each, room left
    assert await control.admitted(Flow("quiet"), 20, budget.place("q1", 20)) == Local(200, b"q1")  # at once
    for lease in ("n0", "n1", "q1"):
        budget.left += 20
        control.released(lease)
    await asyncio.gather(*noisy)
    assert budget.placed[-2:] == ["n2", "n3"]


def test_a_flood_cannot_fill_the_queue_against_another_flow() -> None:
    queue = FlowQueue(4)
    flood = [Waiting("noisy", 0, 10) for _ in range(4)]
    for waiting in flood:
        queue.push(waiting)
    assert queue.room_for(Waiting("quiet", 0, 10)) == [flood[-1]]  # the flood's newest makes room
    assert queue.room_for(Waiting("noisy", 0, 10)) is None  # the flood itself: refused
    assert queue.room_for(Waiting("quiet", -1, 10)) is None  # a lower band takes nothing from a higher


async def test_a_lower_band_leaves_room_for_an_active_higher_one() -> None:
    budget = Budget(200)
    control = _sharing(budget, 200)
    await control.admitted(Flow("hi", priority=10), 80, budget.place("h0", 80))
    budget.left += 80
    control.released("h0")  # hi is idle, and active
    await control.admitted(Flow("std"), 80, budget.place("s0", 80))  # one request, hi's room left
    batch = asyncio.create_task(control.admitted(Flow("batch", priority=-1), 80, budget.place("b0", 80)))
    await asyncio.sleep(0.01)
    assert budget.placed == ["h0", "s0"] and budget.left == 120  # batch waits: the room is hi's
    assert await control.admitted(Flow("hi", priority=10), 80, budget.place("h1", 80)) == Local(200, b"h1")
    for lease in ("s0", "h1"):
        budget.left += 80
        control.released(lease)
    assert await batch == Local(200, b"b0")


def _evicting(budget: Budget, tokens: int, evicted: list[str], **config: object) -> FlowControl:
    """`_sharing` with eviction on; an eviction ends the request at once (its tokens back)."""
    control = FlowControl(
        AdmissionConfig(queue_timeout_s=5, evict_sheddable=True, **config),  # type: ignore[arg-type]
        lambda: False,
        budget.given_back.append,
        budget=lambda: tokens,
        lease=lambda plan: plan.body.decode(),
    )

    def evict(lease: str, error: GatewayError) -> str:
        assert error.status == 429 and error.code == "evicted" and error.retry_after >= 1
        evicted.append(lease)
        return f"request-{lease}"

    control.evict = evict
    return control


def _ends(budget: Budget, control: FlowControl, lease: str, tokens: int) -> None:
    budget.left += tokens
    control.released(lease)


async def test_a_higher_band_kept_out_by_capacity_evicts_the_lowest_newest_sheddable() -> None:
    budget, evicted = Budget(100), []
    control = _evicting(budget, 100, evicted)
    for name, priority in (("b0", -1), ("b1", -1), ("c0", -2), ("s0", 0)):
        await control.admitted(Flow(name, priority=priority), 25, budget.place(name, 25))
    urgent = asyncio.create_task(control.admitted(Flow("hi", priority=5), 25, budget.place("h", 25)))
    await asyncio.sleep(0.01)
    assert evicted == ["c0"]  # the lowest band first; 25 tokens coming cover the 25 it needs
    await asyncio.sleep(0.12)  # ticks while the eviction's room is coming: nothing more ends
    assert evicted == ["c0"] and control.snapshot()["evicted"] == 1
    _ends(budget, control, "c0", 25)
    assert await urgent == Local(200, b"h")
    big = asyncio.create_task(control.admitted(Flow("hi", priority=5), 50, budget.place("h2", 50)))
    await asyncio.sleep(0.01)
    assert evicted == ["c0", "b1", "b0"]  # newest first, two for the 50 it needs; never band 0
    for lease in ("b1", "b0"):
        _ends(budget, control, lease, 25)
    assert await big == Local(200, b"h2")


async def test_eviction_ends_no_more_than_allowed_and_nothing_of_its_own_band() -> None:
    budget, evicted = Budget(100), []
    control = _evicting(budget, 100, evicted, max_evictions_per_decision=1)
    for name in ("b0", "b1", "b2", "b3"):
        await control.admitted(Flow(name, priority=-1), 25, budget.place(name, 25))
    same_band = asyncio.create_task(control.admitted(Flow("other", priority=-1), 25, budget.place("o", 25)))
    await asyncio.sleep(0.01)
    assert evicted == []  # sheddable work never evicts its own band
    urgent = asyncio.create_task(control.admitted(Flow("hi", priority=0), 50, budget.place("h", 50)))
    await asyncio.sleep(0.01)
    assert evicted == ["b3"]  # one per decision; the next tick ends the next
    await asyncio.sleep(0.1)
    assert evicted == ["b3", "b2"]
    for lease in ("b3", "b2"):
        _ends(budget, control, lease, 25)
    assert await urgent == Local(200, b"h")
    same_band.cancel()


async def test_off_nothing_is_evicted_and_a_stream_with_nothing_left_is_not_counted() -> None:
    budget, evicted = Budget(50), []
    control = _evicting(budget, 50, evicted)
    control.evict = lambda lease, error: None  # its answer had already ended
    for name in ("b0", "b1"):
        await control.admitted(Flow(name, priority=-1), 25, budget.place(name, 25))
    urgent = asyncio.create_task(control.admitted(Flow("hi", priority=1), 25, budget.place("h", 25)))
    await asyncio.sleep(0.05)
    assert control.snapshot()["evicted"] == 0
    _ends(budget, control, "b1", 25)
    assert await urgent == Local(200, b"h")
    plain = Budget(50)
    off = _sharing(plain, 50)
    off.evict = lambda lease, error: pytest.fail("evicted with eviction off")
    await off.admitted(Flow("b", priority=-1), 50, plain.place("b", 50))
    waiter = asyncio.create_task(off.admitted(Flow("hi", priority=1), 25, plain.place("h", 25)))
    await asyncio.sleep(0.05)
    _ends(plain, off, "b", 50)
    assert await waiter == Local(200, b"h")


class _SlowDerender:
    """A stream derender whose next chunk takes until `go` is set."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.done = False

    async def feed(self, raw: bytes) -> bytes:
        await self.go.wait()
        return b"data: late\n\n"

    async def finish(self) -> bytes:
        return b"data: [DONE]\n\n"


async def test_a_stream_interrupted_while_a_chunk_derenders_sends_nothing_after_its_end() -> None:
    """An eviction lands while the engine's last chunk is being derendered: the eviction
    notice is the stream's end, and the derendered chunk is not sent after it (Envoy would
    reset the client's stream: the client saw a protocol error)."""
    derender = _SlowDerender()
    handler = StreamResponse(derender)  # type: ignore[arg-type]
    outs: list[object] = []

    async def body() -> None:
        outs.extend([out async for out in handler.on_body(b"data: {}\n\n", False)])

    task = asyncio.create_task(body())
    await asyncio.sleep(0.01)
    notice = handler.interrupted(QueueRefusal("request evicted by flow control", "evicted", 1))
    derender.go.set()
    await task
    assert isinstance(notice, Chunk) and notice.end and b'"code":"evicted"' in notice.data
    assert outs == [] and handler.done
