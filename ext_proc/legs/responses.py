"""Response handlers: what the client gets from what the engine sent, as status, headers and
bytes (no protos: the Envoy adapter wraps them).

- `PassthroughResponse`: the engine's own response, untouched (native path, `/v1/models`);
- `StreamResponse`: generate SSE through the streaming derender pipeline, chunk by chunk;
- `BufferedResponse`: a whole generate JSON (derendered once; streamed to a client that asked
  for a stream the engine answers whole), or an engine error (made an OpenAI error),
  collected under a size cap; an engine without token-only generate (403/404/501
  before any output) gets the request once more on its native endpoint, from the processor
  (`replay_native`; RFC fault table, "token-only Engine 能力").
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

import httpx
import orjson

from ext_proc.byte_budget import StreamBytes
from ext_proc.derender.pipeline import Derenderer, PerTokenSteps, StreamDerender
from ext_proc.errors import GatewayError, error_body, normalize_error_body
from ext_proc.planning.plan import Plan, TokenOnly
from ext_proc.protocol import OpenAIRequest, TokenizedRequest

JSON = "application/json"
SSE = "text/event-stream"
# What an engine without token-only generate answers: 403 is vLLM 0.32 started without
# --enable-scale-out ("Scale-out endpoints are disabled"), 404/501 a missing route.
UNSUPPORTED_STATUSES = frozenset({403, 404, 501})


@dataclass(frozen=True)
class Head:
    """The response headers the client gets: the engine's, or this status and content type."""

    status: int | None = None
    content_type: str | None = None
    same_body: bool = False  # the engine's body goes unchanged: its content-length still holds


@dataclass(frozen=True)
class Chunk:
    data: bytes
    end: bool


@dataclass(frozen=True)
class Refuse:
    """An answer instead of the engine's response: the client has nothing yet, and the
    engine's stream is dropped."""

    status: int
    body: bytes


Out = Head | Chunk | Refuse
Outs = AsyncIterator[Out]


class ResponseHandler(Protocol):
    done: bool  # the client's response is complete: later engine bytes are dropped

    def on_headers(self, status: int, content_type: str, end: bool) -> Outs: ...

    def on_body(self, data: bytes, end: bool) -> Outs: ...

    def on_trailers(self) -> Outs: ...


def handler_for(
    plan: Plan | None,
    status: int,
    content_type: str,
    derender: Derenderer,
    held: StreamBytes,
    cap: int,
    replay: Callable[[bool], Outs],
) -> ResponseHandler:
    """Which handler takes the engine's response: decided by the plan and the response headers."""
    if not isinstance(plan, TokenOnly):
        return PassthroughResponse()
    tokenized = plan.tokenized
    if status == 200 and tokenized.stream and content_type.startswith("text/event-stream"):
        return StreamResponse(StreamDerender(PerTokenSteps(derender.stream(tokenized))))
    return BufferedResponse(tokenized, derender, held, cap, replay)


class PassthroughResponse:
    done = False

    async def on_headers(self, status: int, content_type: str, end: bool) -> Outs:
        yield Head(same_body=True)

    async def on_body(self, data: bytes, end: bool) -> Outs:
        yield Chunk(data, end)

    async def on_trailers(self) -> Outs:
        return
        yield


class StreamResponse:
    def __init__(self, derender: StreamDerender) -> None:
        self._derender = derender
        self.done = False

    async def on_headers(self, status: int, content_type: str, end: bool) -> Outs:
        yield Head()
        if end:
            yield Chunk(await self._derender.finish(), True)
            self.done = True

    async def on_body(self, data: bytes, end: bool) -> Outs:
        out = await self._derender.feed(data)
        if end:
            out += await self._derender.finish()
        # [DONE] or a failure ends the client's response; ending it early also ends the
        # engine's stream, so it never generates for nobody.
        self.done = end or self._derender.done
        if out or self.done:
            yield Chunk(out, self.done)

    async def on_trailers(self) -> Outs:
        if not self.done:
            self.done = True
            yield Chunk(await self._derender.finish(), False)


class BufferedResponse:
    def __init__(
        self,
        tokenized: TokenizedRequest,
        derender: Derenderer,
        held: StreamBytes,
        cap: int,
        replay: Callable[[bool], Outs],
    ) -> None:
        self._tokenized = tokenized
        self._derender = derender
        self._held = held
        self._cap = cap
        self._replay = replay  # the same request on the engine's native endpoint
        self._status = 200
        self._pieces: list[bytes] = []  # joined once at the end: no re-allocation while it grows
        self._size = 0
        self.done = False

    async def on_headers(self, status: int, content_type: str, end: bool) -> Outs:
        self._status = status
        if end:
            async for out in self._finish(True):
                yield out
        # otherwise the headers wait for the whole body: the status may change

    async def on_body(self, data: bytes, end: bool) -> Outs:
        self._size += len(data)
        if self._size > self._cap:
            self.done = True
            yield Refuse(*_error(502, f"engine response exceeds {self._cap} bytes", "engine_response_too_large"))
            return
        if not self._held.take(len(data)):
            self.done = True
            yield Refuse(*_error(503, "the gateway is out of response buffer space", "overloaded"))
            return
        self._pieces.append(data)
        if end:
            async for out in self._finish(True):
                yield out

    async def on_trailers(self) -> Outs:
        if not self.done:
            async for out in self._finish(False):
                yield out

    async def _finish(self, end: bool) -> Outs:
        self.done = True
        upstream, self._pieces = b"".join(self._pieces), []
        self._held.release()
        status = self._status
        if status != 200 and token_only_unsupported(status, upstream):
            async for out in self._replay(end):
                yield out
            return
        if status == 200 and self._tokenized.stream:  # a stream the engine answered whole
            yield Head(200, SSE)
            yield Chunk(await StreamDerender(self._derender.stream(self._tokenized)).whole(upstream), end)
            return
        if status == 200:
            try:
                body = await self._derender.whole(self._tokenized, upstream)
            except GatewayError as error:
                status, body = error.status, error.body
        else:
            body = normalize_error_body(status, upstream)
        yield Head(status, JSON)
        yield Chunk(body, end)


def _error(status: int, message: str, code: str) -> tuple[int, bytes]:
    return status, GatewayError(status, message, code=code).body


async def error_answer(error: GatewayError, end: bool) -> Outs:
    """The gateway's own error as the client's whole response, instead of the engine's."""
    yield Head(error.status, JSON)
    yield Chunk(error.body, end)


async def replay_native(
    http: httpx.AsyncClient, address: str, request: OpenAIRequest, idle_timeout_s: float, end: bool
) -> Outs:
    """The engine's native answer as the client's response: headers, then its body as it comes."""
    timeout = httpx.Timeout(connect=5.0, read=idle_timeout_s, write=idle_timeout_s, pool=5.0)
    started = False
    try:
        async with http.stream(
            "POST",
            f"http://{address}{request.api.value}",
            content=orjson.dumps(request.engine_body()),
            headers={"content-type": JSON},
            timeout=timeout,
        ) as response:
            yield Head(response.status_code, response.headers.get("content-type", JSON))
            started = True
            async for data in response.aiter_raw():
                if data:
                    yield Chunk(data, False)
    except httpx.HTTPError as exc:
        if not started:
            yield Head(502, JSON)
            yield Chunk(
                error_body(502, f"native replay on {address} failed: {exc!r}", code="native_replay_failed"), end
            )
            return
    yield Chunk(b"", end)


def token_only_unsupported(status: int, body: bytes) -> bool:
    """403/404/501 from generate, unless it is the engine's verdict on the request's model."""
    if status not in UNSUPPORTED_STATUSES:
        return False
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return True
    return not (isinstance(error, dict) and error.get("param") == "model")
