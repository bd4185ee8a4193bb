"""Response handlers: what the client gets from what the engine sent, as status, headers and
bytes (no protos: the Envoy adapter wraps them).

- `PassthroughResponse`: the engine's own response, untouched (native path, `/v1/models`);
- `StreamResponse`: generate SSE through the streaming derender pipeline, chunk by chunk;
- `ConvertedResponse`: an Anthropic Messages or OpenAI Responses request's answer: the
  chat or completions answer any of the others makes, converted as native vLLM converts it;
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
from ext_proc.derender.streaming import DONE_EVENT, SSEFramer, sse_event
from ext_proc.errors import GatewayError, error_body, normalize_error_body
from ext_proc.planning.plan import Plan, TokenOnly, conversion
from ext_proc.protocol import Conversion, OpenAIRequest, StreamConversion, TokenizedRequest

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

    def interrupted(self, error: GatewayError) -> Chunk | Refuse:
        """The answer ends now with this error (a bug, the drain deadline): the stream's last
        event once the client has headers, else the error as the whole answer."""
        ...


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
    handler: ResponseHandler
    if not isinstance(plan, TokenOnly):
        handler = PassthroughResponse()
    elif status == 200 and plan.tokenized.stream and content_type.startswith("text/event-stream"):
        handler = StreamResponse(StreamDerender(PerTokenSteps(derender.stream(plan.tokenized))))
    else:
        handler = BufferedResponse(plan.tokenized, derender, held, cap, replay)
    converted = conversion(plan)
    return handler if converted is None else ConvertedResponse(handler, converted)


def refusal(plan: Plan | None, error: GatewayError) -> Refuse:
    """The gateway's error as the whole answer, in the envelope of the client's API."""
    converted = conversion(plan)
    return Refuse(error.status, error.body if converted is None else converted.error(error.status, error.body))


class PassthroughResponse:
    done = False

    def interrupted(self, error: GatewayError) -> Chunk | Refuse:
        return Refuse(error.status, error.body)

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
        if self.done:  # interrupted while it derendered (an eviction): its last event is out
            return
        # [DONE] or a failure ends the client's response; ending it early also ends the
        # engine's stream, so it never generates for nobody.
        self.done = end or self._derender.done
        if out or self.done:
            yield Chunk(out, self.done)

    async def on_trailers(self) -> Outs:
        if not self.done:
            self.done = True
            yield Chunk(await self._derender.finish(), False)

    def interrupted(self, error: GatewayError) -> Chunk | Refuse:
        self.done = True
        return Chunk(sse_event(error.body) + DONE_EVENT, True)


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

    def interrupted(self, error: GatewayError) -> Chunk | Refuse:
        return Refuse(error.status, error.body)

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


class ConvertedResponse:
    """The inner API's answer the inner handler makes, as native's answer in the client's API
    (`protocol.Conversion`): a stream through the stream converter, a whole answer (held until
    complete: its status may change) through the whole converter, errors in its envelope."""

    def __init__(self, inner: ResponseHandler, conversion: Conversion) -> None:
        self._inner = inner
        self._conversion = conversion
        self._engine = (200, JSON)  # the engine's status and content type
        self._head: Head | None = None  # a whole answer's, sent with its body
        self._stream: StreamConversion | None = None
        self._framer = SSEFramer()
        self._pieces: list[bytes] = []

    @property
    def done(self) -> bool:
        return self._inner.done

    @done.setter
    def done(self, value: bool) -> None:
        self._inner.done = value

    async def on_headers(self, status: int, content_type: str, end: bool) -> Outs:
        self._engine = (status, content_type)
        async for converted in self._converted(self._inner.on_headers(status, content_type, end)):
            yield converted

    async def on_body(self, data: bytes, end: bool) -> Outs:
        async for converted in self._converted(self._inner.on_body(data, end)):
            yield converted

    async def on_trailers(self) -> Outs:
        async for converted in self._converted(self._inner.on_trailers()):
            yield converted
        if self._head is not None:  # a whole answer the trailers end
            whole = self._whole(end=False)
            await self._conversion.finished()
            for converted in whole:
                yield converted

    async def _converted(self, outs: Outs) -> Outs:
        """The inner handler's outputs converted; the conversion finished before the last."""
        async for out in outs:
            for converted in self._convert(out):
                if isinstance(converted, Chunk) and converted.end:
                    await self._conversion.finished()
                yield converted

    def close(self) -> None:
        """The exchange ended: a stream the client left is not left suspended."""
        if self._stream is not None:
            self._stream.close()

    def interrupted(self, error: GatewayError) -> Chunk | Refuse:
        """The error in the client's API: as its whole answer, or its stream's error event."""
        out = self._inner.interrupted(error)
        if isinstance(out, Refuse) or self._stream is None:
            return Refuse(error.status, self._conversion.error(error.status, error.body))
        return Chunk(self._stream.ended(error.status, error.body), True)

    def _convert(self, out: Out) -> list[Out]:
        if isinstance(out, Refuse):
            return [Refuse(out.status, self._conversion.error(out.status, out.body))]
        if isinstance(out, Head):
            status = out.status if out.status is not None else self._engine[0]
            content_type = out.content_type if out.content_type is not None else self._engine[1]
            if status == 200 and content_type.startswith(SSE):
                self._stream = self._conversion.stream()
                return [Head(out.status, out.content_type)]  # the body changes: no content-length
            self._head = Head(status, JSON)
            return []
        if self._stream is not None:
            payloads = self._framer.feed(out.data) + (self._framer.flush() if out.end else [])
            data = self._stream.convert(payloads, end=out.end)
            return [Chunk(data, out.end)] if data or out.end else []
        self._pieces.append(out.data)
        return self._whole(end=True) if out.end else []

    def _whole(self, end: bool) -> list[Out]:
        body, self._pieces = b"".join(self._pieces), []
        status = self._head.status if self._head is not None and self._head.status is not None else self._engine[0]
        self._head = None
        if status == 200:
            status, body = self._conversion.whole(body)
        else:
            body = self._conversion.error(status, body)
        return [Head(status, JSON), Chunk(body, end)]


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
            f"http://{address}{request.endpoint}",
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
