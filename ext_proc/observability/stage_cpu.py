"""Where one request's processor CPU goes, stage by stage (`processor.profile_stages`).

Thread CPU time of the event loop, charged to the stage its request is in: every task of
the loop runs wrapped (`install`), and each step of a task charges the CPU it took to the
current stage of the request whose context it runs in. Steps of other requests in between
charge theirs, so the figures hold at any concurrency. What runs outside tasks (gRPC's and
the HTTP client's callbacks, the loop itself) is the loop thread's CPU less the sum; threads
other than the loop's are counted apart (`/debug/stages`).

Off by default: a wrapped step costs two `thread_time` reads. The stages, in request order,
are `STAGES`; `tests/bench/start_profile.py` prints them per request.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Coroutine, Generator
from contextvars import Context
from typing import Any

_cpu = time.thread_time

STAGES = (
    "stream open",  # the exchange and its record made (gRPC's new stream)
    "request headers",
    "request body",  # body messages read and held
    "parse",  # the body's JSON and the API's request model
    "render",  # the tokenization call (render sidecar over HTTP, or in process)
    "plan",  # admission, flow control, the scheduler's pick
    "generate body",  # the token-only body and the routed messages
    "response headers",
    "first chunk",  # the first engine body message derendered
    "later chunks",
    "end",  # trailers, the last reply
    "records",  # release: leases, metrics, logs, spans
)


class StageClock:
    """One request's CPU by stage; the clock runs only while one of its tasks runs."""

    __slots__ = ("stage", "since", "spent", "messages", "replies")

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.since = _cpu()
        self.spent: dict[str, float] = {}
        self.messages = 0  # Envoy's ext_proc messages for the request
        self.replies = 0  # the processor's messages back

    def mark(self, stage: str) -> None:
        """The request moves on to `stage`: what ran since the last mark was the old one's."""
        now = _cpu()
        self.spent[self.stage] = self.spent.get(self.stage, 0.0) + now - self.since
        self.stage, self.since = stage, now

    def resume(self) -> None:
        self.since = _cpu()

    def pause(self) -> None:
        self.mark(self.stage)


class StageProfile:
    """The process's sums over finished requests (what `/debug/stages` shows)."""

    def __init__(self, keep: int = 100_000) -> None:
        self._finished: collections.deque[StageClock] = collections.deque(maxlen=keep)
        self.requests = 0

    def finished(self, clock: StageClock) -> None:
        # Summed when read: CPU the request spends after its record finished (the rest of
        # its release, its tasks ending) still lands in the clock meanwhile.
        self._finished.append(clock)
        self.requests += 1

    def totals(self) -> dict[str, Any]:
        stages: dict[str, float] = dict.fromkeys(STAGES, 0.0)
        for clock in self._finished:
            for stage, seconds in clock.spent.items():
                stages[stage] = stages.get(stage, 0.0) + seconds
        return {
            "requests": self.requests,
            "kept": len(self._finished),
            "stages_s": stages,
            "messages": sum(clock.messages for clock in self._finished),
            "replies": sum(clock.replies for clock in self._finished),
            "loop_thread_s": _cpu(),
        }


class _Timed(Coroutine[Any, Any, Any]):
    """A task's coroutine, its steps charged to its request's current stage."""

    __slots__ = ("_coro", "_clock_of")

    def __init__(self, coro: Coroutine[Any, Any, Any], clock_of: Callable[[], StageClock | None]) -> None:
        self._coro = coro
        self._clock_of = clock_of

    def send(self, value: Any) -> Any:
        return self._step(self._coro.send, value)

    def throw(self, *args: Any) -> Any:
        return self._step(self._coro.throw, *args)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, Any]:
        return self._coro.__await__()

    def _step(self, step: Callable[..., Any], *args: Any) -> Any:
        if (clock := self._clock_of()) is not None:
            clock.resume()
        try:
            return step(*args)
        finally:
            # (the step may have made the request's record: its clock started then)
            if (clock := self._clock_of()) is not None:
                clock.pause()


def install(loop: asyncio.AbstractEventLoop, clock_of: Callable[[], StageClock | None]) -> None:
    """Every task made on `loop` from now on runs timed (`clock_of`: the current request's
    clock, read in the task's own context)."""

    def factory(
        loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], context: Context | None = None
    ) -> asyncio.Task[Any]:
        return asyncio.Task(_Timed(coro, clock_of), loop=loop, context=context)

    loop.set_task_factory(factory)  # type: ignore[arg-type]
