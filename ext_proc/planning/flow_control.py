"""The waiting room in front of admission (flow control, docs/flow-control.md): a request that
does not fit (the token budget is full, or every engine is saturated by its own metrics)
waits instead of being refused, bounded in requests, tokens and `admission.queue_timeout_s`.
Who goes next is `scheduler.FlowQueue`'s (priority band, then fair share across flows).

Fair share holds in admission too, not only in the queue's order: while several flows are
active (a request in flight or waiting, or one seen within `admission.flow_active_s`), a flow
may hold at most its weighted share of the token budget (always at least one request), and
while a higher band has an active flow holding nothing, room for one request stays free for
it. A flow sending ten times as much cannot fill the budget, and a lower band cannot take the
last room a higher one needs: their next requests are admitted on arrival.

A waiting request is placed by the dispatcher when room frees (a lease is released) or on a
short tick while anything waits (saturation moves with the engines' metrics, not with
releases): its placement runs in the request's own context, so its record sees its legs. A
client that leaves while queued is removed at once (its task is cancelled); a request placed
in the instant its client left gives its legs back. Off (`queue_timeout_s: 0`): a request
that does not fit is refused at once, as before flow control.

Eviction (`admission.evict_sheddable`, llm-d's `enableEviction`): while the highest band's next
request is kept out by capacity, sheddable requests of a lower band in flight are ended, the
lowest band's newest first, until the room they free covers it. Their clients are told (429
`evicted` before their answer started, else the stream's error event and [DONE]), and their
tokens come back as their streams end; until then (or `EVICTION_GRACE_S`) that room counts
as coming, so one waiting request does not end more than it needs."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ext_proc.config_routing import AdmissionConfig
from ext_proc.errors import GatewayError
from ext_proc.planning.plan import Plan
from ext_proc.protocol import Flow
from scheduler import FlowQueue, Waiting

log = logging.getLogger("tito.flow")
TICK_S = 0.05  # while anything waits: saturation is re-read this often
BUDGET_FULL = "token_budget_exceeded"  # scheduling's refusal when admission has no room
MAX_ACTIVE_FLOWS = 10_000  # flows remembered as recently active, before idle ones are dropped
EVICTION_GRACE_S = 10.0  # an evicted request's tokens count as coming back this long at most


class QueueRefusal(GatewayError):
    """A request flow control refuses (queue full, shed, timed out): 429 with Retry-After."""

    def __init__(self, message: str, code: str, retry_after: int) -> None:
        super().__init__(429, message, code=code, retry_after=retry_after)


@dataclass
class _Hold:
    """Tokens a placed request holds of its flow's share, until its lease goes back."""

    flow: str
    tokens: int
    priority: int
    number: int  # arrival order: the newest is evicted first
    evicted_at: float | None = None  # when flow control ended it (its tokens are coming back)


@dataclass(eq=False)
class _Entry:
    waiting: Waiting
    place: Callable[[], Plan]
    context: contextvars.Context
    future: asyncio.Future[Plan]
    since: float


class FlowControl:
    def __init__(
        self,
        config: AdmissionConfig,
        saturated: Callable[[], bool],
        give_back: Callable[[Plan], None],
        clock: Callable[[], float] = time.monotonic,
        budget: Callable[[], int | None] = lambda: None,
        lease: Callable[[Plan], str | None] = lambda plan: None,
    ) -> None:
        self._config = config
        self._saturated = saturated  # every engine past a saturation threshold
        self._give_back = give_back  # a placed plan's leases back (its client left meanwhile)
        self._clock = clock
        self._budget = budget  # this process's token budget (None: unlimited, no shares)
        self._lease = lease  # the lease whose release ends a plan's hold on its flow's share
        self._usage: dict[str, int] = {}  # tokens each flow holds, admitted here
        self._holds: dict[str, _Hold] = {}  # lease -> what it holds
        self._seen: dict[str, tuple[float, int, float]] = {}  # flow -> (last arrival, priority, weight)
        self.queue = FlowQueue(config.queue_max_requests, config.queue_max_tokens)
        self._entries: dict[Waiting, _Entry] = {}
        self._ticker: asyncio.Task[None] | None = None
        self.shed = 0
        self.timed_out = 0
        self.evicted = 0
        # (priority band, outcome, seconds queued): metrics (server.py wires them)
        self.on_outcome: Callable[[str, str, float], None] = lambda band, outcome, waited: None
        # Ends the request holding this lease with the error: its request id, or None if it
        # had no answer left to end (server.py wires it to the Envoy streams).
        self.evict: Callable[[str, GatewayError], str | None] = lambda lease, error: None

    @property
    def enabled(self) -> bool:
        return self._config.queue_timeout_s > 0

    async def admitted(self, flow: Flow, demand: int, place: Callable[[], Plan]) -> Plan:
        """The request placed now, or once its turn comes; GatewayError: refused."""
        if not self.enabled:
            return place()
        if len(self._seen) > MAX_ACTIVE_FLOWS:  # (names from a header: keep memory bounded)
            self._forget_idle()
        self._seen[flow.name] = (self._clock(), flow.priority, flow.weight)
        waiting = Waiting(flow.name, flow.priority, demand, flow.weight)
        if not self.queue and not self._saturated() and self._within_share(waiting):
            try:
                return self._held(waiting, self._counted(flow, place(), "dispatched"))
            except GatewayError as error:
                if error.code != BUDGET_FULL:
                    raise
        return await self._wait(waiting, place)

    def full_for(self, flow: Flow) -> bool:
        """The queue has no room for the flow's next request whatever its size (none even for
        one of no tokens): it can be refused before its body is read and rendered."""
        return (
            self.enabled
            and bool(self.queue)
            and self.queue.room_for(Waiting(flow.name, flow.priority, 0, flow.weight)) is None
        )

    def refused_full(self, priority: int) -> QueueRefusal:
        """A request the full queue turns away (counted)."""
        self.on_outcome(str(priority), "rejected_queue_full", 0.0)
        return QueueRefusal("the gateway's queue is full", "queue_full", self._retry_after())

    async def _wait(self, waiting: Waiting, place: Callable[[], Plan]) -> Plan:
        shed = self.queue.room_for(waiting)
        if shed is None:
            raise self.refused_full(waiting.priority)
        for victim in shed:
            self._shed(victim, waiting)
        future: asyncio.Future[Plan] = asyncio.get_running_loop().create_future()
        entry = _Entry(waiting, place, contextvars.copy_context(), future, self._clock())
        self.queue.push(waiting)
        self._entries[waiting] = entry
        self._dispatch()  # its turn may be now (others wait only because they are over their share)
        self._tick_soon()
        try:
            return await asyncio.wait_for(asyncio.shield(future), self._config.queue_timeout_s)
        except TimeoutError:
            if _placed(future):  # placed in the same instant: it goes
                return future.result()
            self.timed_out += 1
            self._settle(entry, "rejected_ttl_expired")
            raise QueueRefusal(
                "the request waited its whole queue timeout", "queue_timeout", self._retry_after()
            ) from None
        except asyncio.CancelledError:  # the client left while queued
            if _placed(future):
                self._give_back(future.result())
            else:
                self._settle(entry, "rejected_context_cancelled")
            raise

    def released(self, lease: str) -> None:
        """A lease went back: its flow's hold ends, and waiting requests may go in (after
        the caller is done)."""
        if (hold := self._holds.pop(lease, None)) is not None:
            self._usage[hold.flow] -= hold.tokens
            if not self._usage[hold.flow]:
                del self._usage[hold.flow]
        if self._entries:
            asyncio.get_running_loop().call_soon(self._dispatch)

    def _dispatch(self) -> None:
        while (waiting := self.queue.next(self._within_share)) is not None and not self._saturated():
            entry = self._entries[waiting]
            try:
                plan = entry.context.run(entry.place)
            except GatewayError as error:
                if error.code == BUDGET_FULL:
                    return  # its turn holds until room frees: fair share is not skipped
                self._settle(entry, "rejected_other", error=error)
                continue
            self.queue.dispatched(waiting)  # (its flow's fair share charged before it leaves)
            self._settle(entry, "dispatched", plan=self._held(waiting, plan))
        if self._entries and self._config.evict_sheddable:
            self._evict_for(self.queue.next())

    def _evict_for(self, head: Waiting | None) -> None:
        """The highest band's next request, if capacity keeps it out: sheddable requests of a
        lower band in flight end, the lowest band's newest first, until the room freed and
        coming covers it, at most `max_evictions_per_decision` now."""
        if head is None:
            return
        short = self._short(head)
        for lease, hold in self._victims(head)[: self._config.max_evictions_per_decision]:
            if short <= 0:
                return
            if self._evicted(lease, hold, head):
                short -= hold.tokens

    def _short(self, head: Waiting) -> int:
        """Tokens the request lacks beyond the room free and coming from evictions (saturated
        engines, with no eviction's room coming: one request's worth, at least)."""
        now, budget, used = self._clock(), self._budget(), sum(self._usage.values())
        coming = sum(
            h.tokens for h in self._holds.values() if h.evicted_at is not None and now - h.evicted_at < EVICTION_GRACE_S
        )
        short = 0 if budget is None else head.demand - (budget - used) - coming
        return max(short, 1) if self._saturated() and not coming else short

    def _victims(self, head: Waiting) -> list[tuple[str, _Hold]]:
        """Requests in flight it may end: sheddable, of a lower band, not ended yet; the
        lowest band first, the newest first within it (llm-d's priority-then-time order)."""
        held = [(lease, h) for lease, h in self._holds.items() if h.evicted_at is None]
        return sorted(
            ((lease, h) for lease, h in held if h.priority < min(0, head.priority)),
            key=lambda item: (item[1].priority, -item[1].number),
        )

    def _evicted(self, lease: str, hold: _Hold, head: Waiting) -> bool:
        """The request holding `lease` told and ended (False: its answer had already ended)."""
        hold.evicted_at = self._clock()
        error = QueueRefusal("request evicted by flow control", "evicted", self._retry_after())
        if (request_id := self.evict(lease, error)) is None:
            hold.evicted_at = -math.inf  # never a victim again; its tokens come back as it ends
            return False
        self.evicted += 1
        self.on_outcome(str(hold.priority), "evicted", 0.0)
        log.info(
            "evicted request %s (band %d, %d tokens) for a waiting band %d request",
            request_id,
            hold.priority,
            hold.tokens,
            head.priority,
        )
        return True

    def _within_share(self, waiting: Waiting) -> bool:
        """The flow may take `demand` more: its weighted share of the budget among the active
        flows has room (a flow holding nothing may always take one request), and, while a
        higher band has an active flow holding nothing, room for one more request stays free
        for it, so its next request is admitted on arrival."""
        budget, used = self._budget(), self._usage.get(waiting.flow, 0)
        if budget is None:
            return True
        active = self._active(waiting)
        higher_idle = any(p > waiting.priority and f not in self._usage for f, (p, _) in active.items())
        if sum(self._usage.values()) + waiting.demand * (2 if higher_idle else 1) > budget:
            return False
        share = budget * waiting.weight / sum(weight for _, weight in active.values())
        return not used or used + waiting.demand <= share

    def _active(self, waiting: Waiting) -> dict[str, tuple[int, float]]:
        """The active flows (in flight, waiting, or seen within `flow_active_s`): priority, weight."""
        now = self._clock()
        active = {f: (p, w) for f, (seen, p, w) in self._seen.items() if now - seen <= self._config.flow_active_s}
        active.update({w.flow: (w.priority, w.weight) for w in self._entries})
        active[waiting.flow] = (waiting.priority, waiting.weight)
        return active

    def _held(self, waiting: Waiting, plan: Plan) -> Plan:
        """The plan's tokens count against its flow's share until its lease goes back."""
        if (lease := self._lease(plan)) is not None:
            self._holds[lease] = _Hold(waiting.flow, waiting.demand, waiting.priority, waiting.number)
            self._usage[waiting.flow] = self._usage.get(waiting.flow, 0) + waiting.demand
        return plan

    def _settle(self, entry: _Entry, outcome: str, plan: Plan | None = None, error: Exception | None = None) -> None:
        """It leaves the queue: placed (`plan`), refused (`error`) or gone (neither)."""
        if self._entries.pop(entry.waiting, None) is None:
            return
        self.queue.remove(entry.waiting)
        self.on_outcome(str(entry.waiting.priority), outcome, self._clock() - entry.since)
        if entry.future.done():
            return
        if plan is not None:
            entry.future.set_result(plan)
        elif error is not None:
            entry.future.set_exception(error)
        else:
            entry.future.cancel()

    def _shed(self, victim: Waiting, newcomer: Waiting) -> None:
        """Pushed out of a full queue: sheddable work for a higher band, or a flood's newest
        for another flow's first."""
        self.shed += 1
        entry = self._entries[victim]
        if victim.sheddable and victim.priority < newcomer.priority:
            refusal = QueueRefusal("shed: the gateway is saturated", "shed", self._retry_after())
        else:
            refusal = QueueRefusal("the gateway's queue is full", "queue_full", self._retry_after())
        self._settle(entry, "rejected_shed", error=refusal)

    def _counted(self, flow: Flow, plan: Plan, outcome: str) -> Plan:
        self.on_outcome(str(flow.priority), outcome, 0.0)
        return plan

    def _retry_after(self) -> int:
        """Seconds a refused client should wait: about one queue timeout (at least 1)."""
        return max(1, math.ceil(self._config.queue_timeout_s or 1))

    def _forget_idle(self) -> None:
        now = self._clock()
        for flow in [f for f, (seen, _, _) in self._seen.items() if now - seen > self._config.flow_active_s]:
            del self._seen[flow]

    def _tick_soon(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        """While anything waits: saturation and timeouts move without any release."""
        with contextlib.suppress(asyncio.CancelledError):
            while self._entries:
                self._dispatch()
                await asyncio.sleep(TICK_S)
            self._forget_idle()

    def snapshot(self) -> dict[str, Any]:
        """For /debug/state: who waits, for how long, and what was shed, timed out or evicted."""
        oldest = min((e.since for e in self._entries.values()), default=None)
        waited = 0.0 if oldest is None else round(self._clock() - oldest, 3)
        counts = {"shed": self.shed, "timed_out": self.timed_out, "evicted": self.evicted}
        return {**self.queue.snapshot(), "oldest_wait_s": waited, **counts}


def _placed(future: asyncio.Future[Plan]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None
