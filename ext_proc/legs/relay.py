"""One prompt's engine stream on the processor-owned path, derendered as it arrives, and its
relay (RFC 流式 replay 与重调度; reference-systems.md §1.5).

With relay on, an engine that fails mid-stream (connection lost, an in-band error, its
stream ending before `[DONE]`, no output past the first-/inter-token timeout) is replaced by
another instance that goes on from the ids the client already has: prompt + committed ids,
max_tokens (and min_tokens) less their count, a new lease, no new render. The derender state
needs no rollback: ids reach it only together with the client's bytes for them (one
`steps` call, then the queue), so it always stands exactly at the committed ids. Relay is
refused where a replay cannot be exact (n>1, structured output) once output exists.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from ext_proc.config_routing import RescheduleConfig
from ext_proc.derender.model import cached_tokens
from ext_proc.derender.pipeline import Derenderer, PerTokenSteps, parse_event, whole_events
from ext_proc.derender.streaming import SSEFramer
from ext_proc.errors import GatewayError
from ext_proc.frontend.token_only import generate_body, generate_response
from ext_proc.legs.generate import Opened, open_generate, read_whole
from ext_proc.legs.prefill import prefilled
from ext_proc.legs.trigger import Triggers
from ext_proc.obfuscation import TokenCodec
from ext_proc.observability.request import CHUNK_SAMPLE, current
from ext_proc.planning.plan import Leg, Local, Owned, TokenOnly
from ext_proc.planning.planner import Planner
from ext_proc.protocol import PromptTokens

log = logging.getLogger("tito.relay")
Put = Callable[[bytes], Awaitable[None]]


@dataclass(frozen=True)
class OwnedContext:
    """What processor-owned streams use of the processor's shared services."""

    http: httpx.AsyncClient
    planner: Planner
    derender: Derenderer
    reschedule: RescheduleConfig
    idle_timeout_s: float
    max_response_bytes: int
    codec: TokenCodec | None = None  # token obfuscation: a relay's prompt in physical ids too
    triggers: Triggers | None = None  # Trigger decode legs wait here for their engine's callback
    tokenizer: Any = None  # the engines' (beam search ends beams on its EOS and decodes them with it)


class EngineFailure(Exception):
    """The serving engine failed mid-stream (a relay may continue elsewhere)."""


class PromptStream:
    def __init__(self, ctx: OwnedContext, plan: Owned, index: int, merged: bool) -> None:
        self._ctx = ctx
        self._plan = plan
        self.index = index
        self._leg = plan.legs[index]
        self._first = self._leg  # the original leg: prompt and budget a relay starts from
        self._session = PerTokenSteps(ctx.derender.stream(plan.tokenized, index))
        self._merged = merged  # one of a batch: the fan-out writes the one usage chunk
        self.cached_tokens: int | None = None  # the engine's prefix-cache hits, for that chunk
        self.completion_tokens = 0
        self.committed: list[int] = []  # ids handed to the client (choice 0): a relay's prompt grows by them
        self._open_leases: dict[str, list[str]] = {}  # lease -> hosts that failed it
        # Every engine that broke this stream mid-answer: a relay never goes back to one
        # (`_end` gives the lease, and its failed hosts, back before the relay is placed).
        self._broke: list[str] = []
        self._tasks: set[asyncio.Task[Any]] = set()  # Trigger prefill legs run on callback
        self._awaiting_output = False  # a Trigger decode leg before its first output
        self._hold(self._leg)
        self._opened: Opened | None = None
        self.attempts = 0
        self._record = current()
        self._chunks = 0  # derendered steps (one in CHUNK_SAMPLE is timed)

    @property
    def streaming(self) -> bool:
        """An engine stream is open."""
        return self._opened is not None

    # -- opening ---------------------------------------------------------------------

    def _hold(self, leg: Leg) -> None:
        """A committed leg's leases are this stream's to give back, whatever happens next."""
        for lease in (leg.lease_id, leg.prefill.lease_id if leg.prefill is not None else None):
            if lease is not None:
                self._open_leases.setdefault(lease, [])

    async def open(self) -> None:
        """The current leg's engine answers 200 (GatewayError: no host did). Under Handoff
        its prefill leg runs first."""
        params = None
        if self._leg.prefill is not None:
            params = await self._prefill()
        elif self._leg.trigger:
            params = self._expect_callback()
            self._awaiting_output = True
        leg = self._leg
        failed = self._open_leases.setdefault(leg.lease_id, [])
        trace = {} if self._record is None else self._record.leg(leg.lease_id, leg.hosts, "owned")
        self._opened = await open_generate(
            self._ctx.http, leg.hosts, self._body(leg, params), self._ctx.idle_timeout_s, failed, trace
        )

    async def _prefill(self) -> dict[str, Any] | None:
        """Handoff: the prompt's prefill leg (retried on other prefill instances), leaving the
        decode leg and what prefill returned for it; with no prefill anywhere, the prompt on
        one instance alone (PD-hybrid), else GatewayError. Every prefill lease is back."""
        leg = self._leg
        assert leg.prefill is not None
        planner = self._ctx.planner
        plan = await prefilled(
            planner.handoff_plan(self._plan.tokenized, leg), planner, self._ctx.http, self._ctx.idle_timeout_s
        )
        self._open_leases.pop(leg.prefill.lease_id, None)  # `prefilled` gave it back
        if isinstance(plan, Local):  # the decode lease went back too
            self._open_leases.pop(leg.lease_id, None)
            raise GatewayError(plan.status, "", body=plan.body)
        assert isinstance(plan, TokenOnly)
        if plan.routed.lease_id != leg.lease_id:  # served alone: decode's lease went back, this one is held
            self._open_leases.pop(leg.lease_id, None)
        self._leg = plan.routed
        return plan.kv_transfer_params

    def _expect_callback(self) -> dict[str, Any] | None:
        """Trigger: the decode leg goes first with a metaserver of this attempt; its engine's
        callback brings the prefill leg (`legs/trigger.py`), run among this stream's tasks."""
        assert self._ctx.triggers is not None
        plan = self._ctx.planner.trigger_plan(self._plan.tokenized, self._leg, self.attempts)
        self._ctx.triggers.expect(plan, self._spawn)
        return plan.kv_transfer_params

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _body(self, leg: Leg, kv_transfer_params: dict[str, Any] | None) -> bytes:
        min_tokens = self._first.prompt.sampling_params.get("min_tokens")
        if self.committed and min_tokens:
            min_tokens = max(0, int(min_tokens) - len(self.committed))
        return generate_body(
            leg.prompt,
            leg.max_tokens,
            self._plan.tokenized.shows_sampled_beside_k,
            request_id=leg.lease_id,
            min_tokens=min_tokens or None,
            kv_transfer_params=kv_transfer_params,
            stream=self._plan.tokenized.generate_streams,
            stream_interval=self._plan.stream_interval,
        )

    # -- non-streaming ----------------------------------------------------------------

    async def whole(self) -> bytes:
        """The prompt's whole GenerateResponse (no relay: nothing reached the client yet)."""
        assert self._opened is not None
        body = await read_whole(self._opened, self._ctx.max_response_bytes)
        await self._end(served=True)
        return body

    # -- streaming ----------------------------------------------------------------------

    async def run(self, put: Put) -> None:
        """Until the prompt's output ended; GatewayError when it failed and cannot go on."""
        while True:
            try:
                await self._attempt(put)
                await self._end(served=True)
                if self._record is not None:
                    self._record.completion_tokens += self.completion_tokens
                return
            except EngineFailure as failure:
                await self._relay(str(failure))

    async def _attempt(self, put: Put) -> None:
        assert self._opened is not None
        if not self._plan.tokenized.generate_streams:
            await self._whole_attempt(put)
            return
        framer = SSEFramer()
        chunks = self._opened.response.aiter_raw()
        got_tokens = False
        while True:
            timeout = (
                self._ctx.reschedule.inter_token_timeout_s if got_tokens else self._ctx.reschedule.first_token_timeout_s
            )
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for swallows a cancellation that
                # races a chunk's arrival, and a cancelled producer must stop.
                async with asyncio.timeout(timeout):
                    raw = await anext(chunks)
            except StopAsyncIteration:
                if await self._events(framer.flush(), put):
                    return
                raise EngineFailure("its stream ended before [DONE]") from None
            except TimeoutError:
                raise EngineFailure(f"no output for {timeout:g} s") from None
            except httpx.HTTPError as exc:
                raise EngineFailure(f"connection lost ({type(exc).__name__})") from None
            before = self.completion_tokens
            if await self._events(framer.feed(raw), put):
                return
            got_tokens = got_tokens or self.completion_tokens > before

    async def _whole_attempt(self, put: Put) -> None:
        """An engine that answers whole (`generate_streams`): its answer is the stream's one step."""
        assert self._opened is not None
        try:
            body = await read_whole(self._opened, self._ctx.max_response_bytes)
        except GatewayError as error:
            if error.code == "engine_stream_failed":
                raise EngineFailure(error.message) from None
            raise
        events = whole_events(generate_response(body))
        await self._parsed([(event, b"") for event in events], put)

    async def _events(self, payloads: list[bytes], put: Put) -> bool:
        """Derender what arrived together; True at `[DONE]`."""
        return await self._parsed([(parse_event(payload), payload) for payload in payloads], put)

    async def _parsed(self, items: list[tuple[dict[str, Any] | GatewayError | None, bytes]], put: Put) -> bool:
        """Parsed events with their payloads; True at `[DONE]`."""
        waiting: list[tuple[dict[str, Any], bytes]] = []
        for event, payload in items:
            if isinstance(event, dict):
                if event.get("choices") or not self._merged:
                    waiting.append(self._with_usage(event, payload))
                else:
                    self.cached_tokens = cached_tokens(event.get("usage"))
                continue
            await self._step(waiting, put)
            waiting = []
            if event is None:
                return True
            if event.code == "engine_invalid_event" or event.status < 500:
                raise event  # a 4xx is the request's own fault: another engine would say the same
            raise EngineFailure(f"in-band error: {event.message}")
        await self._step(waiting, put)
        return False

    def _with_usage(self, event: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        """The usage event with the client's counts: after a relay the engine's count the
        committed ids as prompt."""
        if event.get("choices") or not isinstance(event.get("usage"), dict):
            return event, payload
        prompt = len(self._first.prompt.token_ids)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + self.completion_tokens}
        cached = cached_tokens(event["usage"])
        if cached is not None and cached > prompt:  # a relay's cache hits on the committed ids
            usage["prompt_tokens_details"] = {**event["usage"]["prompt_tokens_details"], "cached_tokens": prompt}
        event = {**event, "usage": {**event["usage"], **usage, "completion_tokens": self.completion_tokens}}
        return event, orjson.dumps(event)

    async def _step(self, events: list[tuple[dict[str, Any], bytes]], put: Put) -> None:
        if not events:
            return
        self._chunks += 1
        record = self._record if self._chunks % CHUNK_SAMPLE == 1 else None
        started = time.perf_counter() if record is not None else 0.0
        data = await self._session.steps(events)
        if record is not None:
            record.derendered(started)
        if self._awaiting_output and self._ctx.triggers is not None:  # a Trigger prefill's tokens go back
            self._awaiting_output = False
            self._ctx.triggers.first_chunk(self._leg.lease_id)
        for event, _ in events:
            for choice in event.get("choices") or ():
                ids = choice.get("token_ids") or []
                self.completion_tokens += len(ids)
                if int(choice.get("index", 0)) == 0:
                    self.committed.extend(ids)
        if data:
            await put(data)

    # -- relay -------------------------------------------------------------------------

    async def _relay(self, why: str) -> None:
        assert self._opened is not None
        failed_host = self._opened.host
        self._open_leases[self._leg.lease_id].append(failed_host)
        self._broke.append(failed_host)
        await self._end(served=False)
        refusal = self._refusal()
        if refusal is not None:
            log.warning(
                "relay refused for %s: engine %s failed (%s) after %d tokens; %s",
                self._plan.tokenized.request_id,
                failed_host,
                why,
                self.completion_tokens,
                refusal,
            )
            raise GatewayError(502, f"engine failed mid-stream: {why}", code="engine_stream_failed")
        self.attempts += 1
        ids = self._first.prompt.token_ids + self.committed
        rendered = self._first.prompt.generate_request
        prompt = PromptTokens(ids, {**(rendered or {}), "token_ids": ids})
        if self._ctx.codec is not None:
            prompt = self._ctx.codec.prompt(prompt)  # re-obfuscated, committed ids included
        left = self._first.max_tokens - len(self.committed)
        tried = tuple(dict.fromkeys([*self._broke, *(h for hosts in self._open_leases.values() for h in hosts)]))
        self._leg = self._ctx.planner.prompt_leg(
            self._plan.tokenized, f"{self._first.lease_id}-relay{self.attempts}", prompt, max_tokens=left, exclude=tried
        )  # under Handoff: a new prefill leg of the replay prompt, then a new decode leg
        self._hold(self._leg)
        if self._record is not None:
            self._record.relayed(self._leg.lease_id, failed_host, self._leg.hosts[0], len(self.committed), why)
        await self.open()

    def _refusal(self) -> str | None:
        """Why this failure ends the stream instead of relaying it (None: relay)."""
        if not self._plan.relay:
            return "relay is off for this request"
        if self.attempts + 1 >= self._ctx.reschedule.max_attempts:
            return f"{self._ctx.reschedule.max_attempts} engine streams tried"
        if self.completion_tokens and self._plan.tokenized.n > 1:
            return "n>1 cannot be replayed exactly"
        if self.completion_tokens and self._first.prompt.sampling_params.get("structured_outputs"):
            return "structured output cannot be replayed exactly"
        return None

    # -- the end -------------------------------------------------------------------------

    async def _end(self, served: bool) -> None:
        """The current engine stream is over: closed (which aborts the engine's work if it
        was still generating) and its lease back with the engine's verdict."""
        opened, self._opened = self._opened, None
        if opened is not None:
            await opened.response.aclose()
        self._forget_trigger()
        failed = self._open_leases.pop(self._leg.lease_id, None)
        if failed is not None:
            served_by = opened.host if served and opened is not None else None
            self._ctx.planner.finish(self._leg.lease_id, tuple(failed), served_by)
            if self._record is not None:  # retries are the failures before the 200 (not a relay's)
                retried = failed if served else failed[:-1]
                self._record.leg_done(self._leg.lease_id, served_by, tuple(retried))

    async def aclose(self) -> None:
        """Cancelled or failed: the stream closed, a Trigger prefill leg in flight cancelled,
        every lease back (no verdict)."""
        opened, self._opened = self._opened, None
        if opened is not None:
            await opened.response.aclose()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.release()

    def _forget_trigger(self) -> None:
        """The Trigger decode leg is over: no callback is expected, its prefill lease is back."""
        if self._leg.trigger and self._ctx.triggers is not None:
            self._ctx.triggers.forget(self._leg.lease_id)

    def release(self) -> None:
        self._forget_trigger()
        for lease, failed in list(self._open_leases.items()):
            self._ctx.planner.finish(lease, tuple(failed))
        self._open_leases.clear()
