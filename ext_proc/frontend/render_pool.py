"""Render Pool (RFC): the render endpoints of one base model, balanced, each with its own breaker.

One `render` call of the pool is one client request's tokenization:
- it goes to the endpoint with the least expected wait: the prompt bytes already outstanding
  there plus this request's, times that endpoint's recent render latency (an idle endpoint
  is preferred to a busy one, a fast one to a slow one); endpoints within a factor of 2 of
  the least take turns, since latencies are noisy;
- an endpoint that fails (connect error, timeout, 5xx, 429) counts a failure on its own breaker
  (never on an engine's) and the request is tried once more on another endpoint;
- an endpoint whose breaker is open is skipped. When its cool-down ends, a tiny real render
  (not `/health`: a render server answers it even when it cannot render) probes it; success
  lets it rejoin. With no endpoint left the caller falls back to the local tokenizer.

Saturation is visible: per endpoint, renders in flight, prompt bytes outstanding, breaker state,
p50/p99 of its last renders (`snapshot()`, exported as gauges), a latency histogram per
endpoint (`on_render`) and a warning when an endpoint's p99 exceeds its budget. The endpoint
that served a request is named in its stage line.

In-process render is a pool of one member (`in_process`), so both modes have one code path."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from ext_proc.frontend.render import Renderer, RenderRejected, RenderUnavailable, answered_on
from ext_proc.frontend.render_prefix_cache import PrefixTokenCache
from ext_proc.observability.request import current
from ext_proc.protocol import OpenAIRequest, Pipeline, TokenizedRequest
from scheduler import BreakerConfig, BreakerState, CircuitBreaker

log = logging.getLogger("tito.render")
T = TypeVar("T")

# Worth another endpoint: the endpoint, not the request, failed. (`unsupported` and
# `invalid_response` are the same on every endpoint of a base model.)
RETRIABLE = frozenset({"timeout", "unavailable"})
LATENCY_WINDOW = 256  # renders per endpoint the p50/p99 are taken over
SLOW_CHECK_S = 1.0  # how often an endpoint's p99 is compared with its budget
SLOW_WARN_S = 30.0  # and how often a slow endpoint is warned about
EWMA_ALPHA = 0.2
COMPARABLE = 2.0  # expected waits within this factor of the least count as equal (round robin)
# A latency not measured again for this long counts as unmeasured: an endpoint slow once (a
# cold start, a pause) would otherwise stay out of the turns, as only its renders update it.
LATENCY_STALE_S = 10.0
HEALTH_REQUEST_ID = "tito-render-health"  # the request id of a health render (proxies let it pass)


@dataclass(eq=False)
class RenderMember:
    """One render endpoint: its client, breaker and load."""

    name: str  # host:port, or in_process
    url: str | None  # None: vLLM's renderer in this process
    renderer: Renderer
    breaker: CircuitBreaker
    held_out: bool = False  # capability negotiation: its tokenizer disagrees with the engines'
    in_flight: int = 0
    outstanding_bytes: int = 0
    latency_s: float = 0.0  # EWMA of its renders (0: not measured yet)
    measured_at: float = float("-inf")  # the pool's clock at its last render
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    outcomes: Counter[str] = field(default_factory=Counter)  # ok | rejected | <failure reason> | retried
    next_slow_check: float = 0.0
    warned_at: float = float("-inf")
    prefix_cache: PrefixTokenCache | None = None  # in-process render's (render_prefix_cache.py)

    def latency(self, now: float) -> float:
        """Its render latency, 0 when unmeasured or stale (`LATENCY_STALE_S`)."""
        return self.latency_s if now - self.measured_at <= LATENCY_STALE_S else 0.0

    def expected_wait(self, request_bytes: int, unmeasured_s: float, now: float) -> float:
        """Its outstanding bytes plus these, times its render latency (`unmeasured_s` until
        it has rendered, or again once that is stale: an endpoint not measured lately counts as
        an average one, not as an instant one nor as the slow one it once was)."""
        return (self.outstanding_bytes + request_bytes) * (self.latency(now) or unmeasured_s)

    def quantile_ms(self, q: float) -> float | None:
        if not self.latencies:
            return None
        ordered = sorted(self.latencies)
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def snapshot(self) -> dict[str, Any]:
        return {
            "breaker": self.breaker.state.value,
            "held_out": self.held_out,
            "in_flight": self.in_flight,
            "outstanding_bytes": self.outstanding_bytes,
            "p50_ms": self.quantile_ms(0.5),
            "p99_ms": self.quantile_ms(0.99),
            "outcomes": dict(self.outcomes),
            **({"prefix_cache": self.prefix_cache.snapshot()} if self.prefix_cache is not None else {}),
        }


class RenderPool:
    """A `Renderer` over the members; raises `RenderUnavailable` when none can render."""

    def __init__(
        self,
        members: list[RenderMember],
        served_name: str,
        p99_budget_ms: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.members = members
        self._probe_body = orjson.dumps({"model": served_name, "prompt": "ok", "max_tokens": 1})
        self._p99_budget_ms = p99_budget_ms
        self._clock = clock
        self._turn = 0  # rotates the start of the search: ties go round robin
        # what a render took, per endpoint: (endpoint, seconds, outcome) -> the metrics histogram
        self.on_render: Callable[[str, float, str], None] = lambda endpoint, seconds, outcome: None

    def member(self, name: str) -> RenderMember:
        return next(m for m in self.members if m.name == name)

    # -- a request's render

    async def render(self, request: OpenAIRequest, raw: bytes, request_id: str) -> TokenizedRequest:
        return await self._through(len(raw), request_id, lambda renderer: renderer.render(request, raw, request_id))

    async def answer(self, path: str, raw: bytes, request_id: str) -> tuple[int, bytes]:
        """Render's own answer on another of its routes (`/tokenize`, ...), through the same
        endpoints, breakers and retry as a render (`render.answered` judges it)."""

        async def answered(renderer: Renderer) -> tuple[int, bytes]:
            return answered_on(path, *await renderer.answer(path, raw, request_id))

        return await self._through(len(raw), request_id, answered)

    async def _through(self, size: int, request_id: str, call: Callable[[Renderer], Awaitable[T]]) -> T:
        """`call` on the endpoint picked for a body of `size` bytes, once more on another when
        that endpoint failed; `RenderUnavailable` when none could answer."""
        tried: list[RenderMember] = []
        failure: RenderUnavailable | None = None
        while len(tried) < 2:
            member = self._pick(size, tried)
            if member is None:
                break
            if failure is not None:
                tried[-1].outcomes["retried"] += 1
            tried.append(member)
            try:
                answer = await self._attempt(member, call, size)
            except RenderUnavailable as exc:
                log.warning("render endpoint %s failed for %s (%s)", member.name, request_id, exc)
                failure = exc
                if exc.reason not in RETRIABLE:
                    break
                continue
            if (record := current()) is not None:
                record.render_endpoint = member.name
                record.render_retried = f"{tried[0].name}/{failure.reason}" if failure is not None else ""
            return answer
        if failure is not None:
            raise failure
        if all(m.held_out for m in self.members):
            raise RenderUnavailable("render_canary_mismatch", "every render endpoint's tokenizer disagrees")
        raise RenderUnavailable("render_breaker_open", "every render endpoint's breaker is open")

    def _pick(self, request_bytes: int, tried: list[RenderMember]) -> RenderMember | None:
        """The member with the least expected wait among those whose breaker is closed; else
        one whose cool-down ended (its half-open probe), as with a single endpoint."""
        now = self._clock()
        n = len(self.members)
        start, self._turn = self._turn, (self._turn + 1) % n
        ordered = [self.members[(start + i) % n] for i in range(n)]
        candidates = [m for m in ordered if m not in tried and not m.held_out]
        closed = [m for m in candidates if m.breaker.state is BreakerState.CLOSED]
        if closed:
            measured = [latency for m in self.members if (latency := m.latency(now)) > 0]
            unmeasured_s = sum(measured) / len(measured) if measured else 0.0
            waits = [m.expected_wait(request_bytes, unmeasured_s, now) for m in closed]
            # Latencies are noisy: endpoints within COMPARABLE of the best take turns.
            best = min(waits)
            return next(m for m, wait in zip(closed, waits, strict=True) if wait <= COMPARABLE * best)
        return next((m for m in candidates if m.breaker.allows(now)), None)

    async def _attempt(self, member: RenderMember, call: Callable[[Renderer], Awaitable[T]], size: int) -> T:
        member.breaker.on_dispatch()
        member.in_flight += 1
        member.outstanding_bytes += size
        started = time.perf_counter()
        outcome = "abandoned"
        try:
            answer = await call(member.renderer)
            outcome = "ok"
            return answer
        except RenderRejected:
            outcome = "rejected"  # render works; the request is wrong
            raise
        except RenderUnavailable as exc:
            outcome = exc.reason
            raise
        finally:
            member.in_flight -= 1
            member.outstanding_bytes -= size
            self._settle(member, outcome, time.perf_counter() - started)

    def _settle(self, member: RenderMember, outcome: str, seconds: float) -> None:
        member.outcomes[outcome] += 1
        if outcome == "abandoned":  # cancelled (the client left): no verdict on the endpoint
            member.breaker.record_abandoned()
            return
        self.on_render(member.name, seconds, outcome)
        if outcome not in ("ok", "rejected"):
            member.breaker.record_failure(self._clock())
            return
        member.breaker.record_success()
        now = self._clock()
        previous = member.latency(now)
        member.latency_s = seconds if previous == 0 else previous + EWMA_ALPHA * (seconds - previous)
        member.measured_at = now
        member.latencies.append(seconds)
        self._check_slow(member)

    def _check_slow(self, member: RenderMember) -> None:
        now = self._clock()
        if now < member.next_slow_check:
            return
        member.next_slow_check = now + SLOW_CHECK_S
        p99 = member.quantile_ms(0.99)
        if p99 is not None and p99 > self._p99_budget_ms and now - member.warned_at >= SLOW_WARN_S:
            member.warned_at = now
            log.warning(
                "render endpoint %s is slow: p99 %.0f ms over its last %d renders (budget %.0f ms), %d in flight",
                member.name,
                p99,
                len(member.latencies),
                self._p99_budget_ms,
                member.in_flight,
            )

    # -- health: the way back in

    async def run(self, interval_s: float = 0.5) -> None:
        """Probe every member whose cool-down has ended with a tiny real render; for the
        pool's life (its members' connections close when it ends)."""
        try:
            while True:
                now = self._clock()
                due = [m for m in self.members if m.breaker.state is BreakerState.OPEN and not m.breaker.is_open(now)]
                await asyncio.gather(*(self.probe(m) for m in due))
                await asyncio.sleep(interval_s)
        finally:
            self.close()

    def close(self) -> None:
        for member in self.members:
            member.renderer.close()

    async def probe(self, member: RenderMember) -> bool:
        """One tiny completion rendered on `member`: its breaker closes on success, and opens
        for another cool-down on failure. It takes no probe slot: a client request that comes
        meanwhile may try the endpoint too, rather than fall back to the local tokenizer."""
        if not member.breaker.allows(self._clock()):
            return False
        request = OpenAIRequest(Pipeline.COMPLETIONS, orjson.loads(self._probe_body))
        try:
            await member.renderer.render(request, self._probe_body, HEALTH_REQUEST_ID)
        except (RenderUnavailable, RenderRejected) as exc:
            member.breaker.record_failure(self._clock())
            log.info("render endpoint %s: health render failed (%s); still skipped", member.name, exc)
            return False
        except BaseException:
            member.breaker.record_abandoned()
            raise
        member.breaker.record_success()
        # It rejoins as a new endpoint: latencies measured before it failed (often while it was
        # dying, or under the load that broke it) would keep it out of the turns for good, as
        # nothing updates them until it renders again.
        member.latency_s = 0.0
        member.latencies.clear()
        log.info("render endpoint %s renders again; it rejoins the pool", member.name)
        return True

    # -- state

    def hold_out(self, name: str, held: bool) -> None:
        self.member(name).held_out = held

    def state(self) -> str:
        """closed: an endpoint renders; open: none would be tried now; half_open: one may be probed."""
        now = self._clock()
        usable = [m for m in self.members if not m.held_out]
        if any(m.breaker.state is BreakerState.CLOSED for m in usable):
            return BreakerState.CLOSED.value
        if any(not m.breaker.is_open(now) for m in usable):
            return BreakerState.HALF_OPEN.value
        return BreakerState.OPEN.value

    def snapshot(self) -> dict[str, Any]:
        return {m.name: m.snapshot() for m in self.members}


def pool_member(
    name: str, url: str | None, renderer: Renderer, cooldown_s: float, prefix_cache: PrefixTokenCache | None = None
) -> RenderMember:
    """A member whose breaker opens on its first failure and stays open `cooldown_s`."""
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=1, base_cooldown_s=cooldown_s, max_cooldown_s=cooldown_s))
    return RenderMember(name, url, renderer, breaker, prefix_cache=prefix_cache)
