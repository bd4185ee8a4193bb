"""Who is admitted next when requests wait for admission (flow control, docs/flow-control.md):
the highest priority band first; within a band, the flow furthest behind its fair share;
within a flow, first come first served. Pure bookkeeping: the waiting itself (futures,
timeouts, clients leaving) is `ext_proc/planning/flow_control.py`'s.

Fair share is start-time fair queuing in the tokens admission charges (prompt + n ×
max_tokens): each flow of a band has a virtual time that grows by demand / weight with every
request dispatched, and the flow with the least goes next. A flow that starts waiting again
resumes at the band's current virtual time, so an idle flow banks no credit to burst with.

Bounded in requests and in tokens. When full, a newcomer may push out waiting requests of a
sheddable band (priority below 0) lower than its own, lowest band and newest first; if that
cannot make room, the newcomer is refused."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from typing import Any

_ticket_numbers = count()


@dataclass(eq=False)
class Waiting:
    """One request waiting for admission (compared by identity)."""

    flow: str
    priority: int
    demand: int  # the tokens admission will charge it
    weight: float = 1.0
    number: int = field(default_factory=lambda: next(_ticket_numbers))  # arrival order

    @property
    def sheddable(self) -> bool:
        return self.priority < 0


@dataclass
class _Band:
    flows: dict[str, deque[Waiting]] = field(default_factory=dict)  # flows with requests waiting
    virtual: dict[str, float] = field(default_factory=dict)  # each flow's virtual time
    clock: float = 0.0  # the virtual time of the last dispatch


class FlowQueue:
    def __init__(self, max_requests: int, max_tokens: int | None = None) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._bands: dict[int, _Band] = {}
        self.requests = 0
        self.tokens = 0

    def __len__(self) -> int:
        return self.requests

    def room_for(self, newcomer: Waiting) -> list[Waiting] | None:
        """The waiting requests to push out so the newcomer fits (often none), or None: it
        cannot. First sheddable ones of lower bands; then, so that a flood cannot fill the
        queue and lock the other flows out, the newest of the flow with the most waiting (of
        the newcomer's band or lower) while it has more waiting than the newcomer's flow."""
        out: list[Waiting] = []
        requests, tokens = self.requests, self.tokens
        sheddable = sorted(
            (w for w in self._all() if w.sheddable and w.priority < newcomer.priority),
            key=lambda w: (w.priority, -w.number),
        )
        while not self._fits(requests + 1, tokens + newcomer.demand):
            victim = sheddable.pop(0) if sheddable else self._hogs_newest(newcomer, out)
            if victim is None:
                return None
            out.append(victim)
            requests, tokens = requests - 1, tokens - victim.demand
        return out

    def _hogs_newest(self, newcomer: Waiting, taken: list[Waiting]) -> Waiting | None:
        counts: dict[str, list[Waiting]] = {}
        for w in self._all():
            if w.priority <= newcomer.priority and w not in taken:
                counts.setdefault(w.flow, []).append(w)
        own = len(counts.pop(newcomer.flow, []))
        if not counts:
            return None
        hog = max(counts.values(), key=len)
        return max(hog, key=lambda w: w.number) if len(hog) > own + 1 else None

    def _fits(self, requests: int, tokens: int) -> bool:
        return requests <= self.max_requests and (self.max_tokens is None or tokens <= self.max_tokens)

    def push(self, waiting: Waiting) -> None:
        band = self._bands.setdefault(waiting.priority, _Band())
        if waiting.flow not in band.flows:  # (again) waiting: no credit from its idle time
            band.flows[waiting.flow] = deque()
            band.virtual[waiting.flow] = max(band.virtual.get(waiting.flow, 0.0), band.clock)
        band.flows[waiting.flow].append(waiting)
        self.requests += 1
        self.tokens += waiting.demand

    def next(self, eligible: Callable[[Waiting], bool] = lambda waiting: True) -> Waiting | None:
        """The request to admit next (it stays queued until `dispatched` or `remove`): the
        head of the most-behind flow of the highest band, among flows whose head is
        `eligible` (a flow over its share of the budget waits; others go meanwhile)."""
        for priority in sorted(self._bands, reverse=True):
            heads = [q[0] for q in self._bands[priority].flows.values() if eligible(q[0])]
            if heads:
                band = self._bands[priority]
                return min(heads, key=lambda w: (band.virtual[w.flow], w.number))
        return None

    def dispatched(self, waiting: Waiting) -> None:
        """It was admitted: its flow's virtual time advances by what it was charged."""
        band = self._bands[waiting.priority]
        band.clock = band.virtual[waiting.flow]
        band.virtual[waiting.flow] += waiting.demand / waiting.weight
        self.remove(waiting)
        # Flows no longer waiting and not ahead of the band's clock would restart at the clock.
        for flow in [f for f, v in band.virtual.items() if f not in band.flows and v <= band.clock]:
            del band.virtual[flow]

    def remove(self, waiting: Waiting) -> None:
        """It leaves without being admitted (timed out, its client left, shed)."""
        band = self._bands.get(waiting.priority)
        queue = band.flows.get(waiting.flow) if band is not None else None
        if band is None or queue is None or waiting not in queue:
            return
        queue.remove(waiting)
        self.requests -= 1
        self.tokens -= waiting.demand
        if not queue:
            del band.flows[waiting.flow]

    def _all(self) -> list[Waiting]:
        return [w for band in self._bands.values() for queue in band.flows.values() for w in queue]

    def snapshot(self) -> dict[str, Any]:
        """Waiting requests and tokens per band (priority) and per flow, for /debug/state and metrics."""
        bands: dict[str, Any] = {}
        for priority, band in sorted(self._bands.items(), reverse=True):
            flows = {flow: {"requests": len(q), "tokens": sum(w.demand for w in q)} for flow, q in band.flows.items()}
            if flows:
                bands[str(priority)] = flows
        return {"requests": self.requests, "tokens": self.tokens, "bands": bands}
