"""Derender: generate output (token ids) -> OpenAI responses; one pipeline, two backends.

A prompt's derender session (`Derenderer.stream`) takes the generate events that arrived
together and returns SSE bytes: `in_process` (live detokenizer and parser state,
`in_process.py`: every event is one parser step, and plain-text chunks waiting together
leave as one chunk) or `sidecar` (the render sidecar's /derender, `sidecar.py`: one call
per run of one choice's events). Both transports feed the same sessions, framed by
`SSEFramer` and parsed once by `parse_event`: `StreamDerender` for the engine stream Envoy
routes (body chunks in, exactly one `[DONE]` out, also after an in-band engine error or a
derender failure, as an OpenAI error event), and the processor-owned streams of
`legs/relay.py`. Derender failures never re-run inference.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

import orjson

from ext_proc.config import TitoConfig
from ext_proc.derender.in_process import derender_whole, stream_session
from ext_proc.derender.model import DerenderModel
from ext_proc.derender.sidecar import DerenderClient, SidecarDerender
from ext_proc.derender.streaming import DONE, DONE_EVENT, SSEFramer, sse_event
from ext_proc.errors import GatewayError
from ext_proc.frontend.token_only import generate_response
from ext_proc.obfuscation import TokenCodec
from ext_proc.observability.request import CHUNK_SAMPLE, current
from ext_proc.protocol import TokenizedRequest

log = logging.getLogger("tito.derender")
# A stream session of a prompt up to this many tokens (times n) is made on the loop, a longer
# one on a thread (`_InProcessStream`): 4096 tokens are about 16 KiB of messages, 70 µs to validate.
SESSION_ON_LOOP_MAX_TOKENS = 4096


class StreamSession(Protocol):
    """One prompt's derender state (one entry per choice inside)."""

    async def steps(self, events: list[tuple[dict[str, Any], bytes]]) -> bytes:
        """Parsed generate events (with their raw payloads) that arrived together -> SSE bytes."""
        ...

    @property
    def completion_tokens(self) -> int:
        """Output ids derendered so far, every choice."""
        ...


class Derenderer(Protocol):
    def stream(self, request: TokenizedRequest, prompt_index: int = 0) -> StreamSession: ...

    async def whole(self, request: TokenizedRequest, generate_body: bytes, prompt_index: int = 0) -> bytes:
        """One prompt's whole GenerateResponse -> the OpenAI JSON body."""
        ...


class InProcessDerender:
    """Live state in the processor: the work per event is O(its new ids), on the loop (a few
    tens of µs, measured by `tests/bench/derender_bench.py`); whole responses, which cost
    O(output), run on a thread so a long answer never stalls other streams."""

    def __init__(self, model: DerenderModel) -> None:
        self.model = model

    def stream(self, request: TokenizedRequest, prompt_index: int = 0) -> StreamSession:
        return _InProcessStream(self.model, request, prompt_index)

    async def whole(self, request: TokenizedRequest, generate_body: bytes, prompt_index: int = 0) -> bytes:
        generate = generate_response(generate_body)
        try:
            return await asyncio.to_thread(derender_whole, self.model, request, generate, prompt_index)
        except Exception as exc:
            log.exception("in-process derender failed for %s", request.request_id)
            raise GatewayError(500, "derender failed", code="derender_failed") from exc


class _InProcessStream:
    def __init__(self, model: DerenderModel, request: TokenizedRequest, prompt_index: int) -> None:
        self._request_id = request.request_id
        # Made now, while the engine computes the first token (it validates the whole client
        # request and builds the parsers and the detokenizer); a failure is a stream error at
        # the first event. A short request's session is made on the loop: about 0.35 ms, where
        # a thread's hand-off and the GIL's switches made the same work cost 0.5 ms (`docs/
        # performance.md`). A long one's goes to a thread: megabytes of messages validate in
        # milliseconds (4-5 µs per KiB), which would stall the other streams.
        if len(request.prompts[prompt_index].token_ids) * request.n <= SESSION_ON_LOOP_MAX_TOKENS:
            self._session = asyncio.get_running_loop().create_future()
            try:
                self._session.set_result(stream_session(model, request, prompt_index))
            except Exception as exc:
                self._session.set_exception(exc)
        else:
            self._session = asyncio.ensure_future(asyncio.to_thread(stream_session, model, request, prompt_index))
        self._session.add_done_callback(_consume_error)

    @property
    def completion_tokens(self) -> int:
        done = self._session.done() and not self._session.cancelled() and self._session.exception() is None
        return self._session.result().completion_tokens if done else 0

    async def steps(self, events: list[tuple[dict[str, Any], bytes]]) -> bytes:
        try:
            session = await asyncio.shield(self._session)
            return bytes(session.steps([event for event, _ in events]))
        except Exception as exc:
            log.exception("in-process stream derender failed for %s", self._request_id)
            raise GatewayError(500, "derender failed", code="derender_failed") from exc


def _consume_error(future: asyncio.Future[Any]) -> None:
    """A session nobody fed (the client left first) must not log 'exception never retrieved'."""
    if not future.cancelled():
        future.exception()


class SemanticDerender:
    """Token obfuscation's decoding side: engine ids made semantic, in place, before either
    backend (or a relay counting committed ids) sees them. A decoded event goes on without
    its raw payload (the sidecar serializes the event instead; in-process never reads it)."""

    def __init__(self, inner: Derenderer, codec: TokenCodec) -> None:
        self._inner = inner
        self._codec = codec

    def stream(self, request: TokenizedRequest, prompt_index: int = 0) -> StreamSession:
        return _SemanticStream(self._inner.stream(request, prompt_index), self._codec)

    async def whole(self, request: TokenizedRequest, generate_body: bytes, prompt_index: int = 0) -> bytes:
        generate = generate_response(generate_body)
        self._codec.semantic_event(generate)
        return await self._inner.whole(request, orjson.dumps(generate), prompt_index)


class _SemanticStream:
    def __init__(self, inner: StreamSession, codec: TokenCodec) -> None:
        self._inner = inner
        self._codec = codec

    @property
    def completion_tokens(self) -> int:
        return self._inner.completion_tokens

    async def steps(self, events: list[tuple[dict[str, Any], bytes]]) -> bytes:
        for event, _ in events:
            self._codec.semantic_event(event)
        return await self._inner.steps([(event, b"") for event, _ in events])


class PerTokenSteps:
    """A session fed one token per step, whatever an engine event carries: k tokens when the
    gateway asked for them (`derender.stream_interval`), several when the engine's API server
    merged steps its reader had not taken yet (load). Native serving's parsers see one token
    per engine step unless native is loaded the same way, and a parser fed several at once may
    split reasoning, content and tool calls otherwise (vllm#41691): so the answer is native's
    own, one token per step, however the events came. (A speculating engine's native answer
    parses its multi-token steps whole; the gateway's stays one token per step.) The messages
    saved are the engine's and ext_proc's; the parser's work stays per token."""

    def __init__(self, inner: StreamSession) -> None:
        self._inner = inner

    @property
    def completion_tokens(self) -> int:
        return self._inner.completion_tokens

    async def steps(self, events: list[tuple[dict[str, Any], bytes]]) -> bytes:
        split: list[tuple[dict[str, Any], bytes]] = []
        for event, payload in events:
            pieces = per_token(event)
            split += [(event, payload)] if pieces is None else [(piece, b"") for piece in pieces]
        return await self._inner.steps(split)


def per_token(event: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A generate event of several tokens as one event per token (None: it has at most one
    per choice). The finish and stop reasons and the final-chunk fields go with the last."""
    choices = event.get("choices")
    if not isinstance(choices, list) or not all(isinstance(choice, dict) for choice in choices):
        return None  # not a generate event: the session says so, as for any other
    if not any(isinstance(ids := choice.get("token_ids"), list) and len(ids) > 1 for choice in choices):
        return None
    out = []
    for choice in choices:
        ids = choice.get("token_ids")
        if not isinstance(ids, list):
            ids = []
        logprobs = choice.get("logprobs")
        entries = logprobs.get("content") if isinstance(logprobs, dict) else None
        for i in range(max(len(ids), 1)):  # a choice's event without ids stays one
            piece = {**choice, "token_ids": ids[i : i + 1]}
            if isinstance(entries, list):
                piece["logprobs"] = {"content": entries[i : i + 1]}
            if i < len(ids) - 1:
                piece.update(finish_reason=None, stop_reason=None, weight_versions=None)
            out.append({**event, "choices": [piece]})
    return out


class SidecarWhereItCan:
    """Sidecar mode, but for what vLLM 0.32's /derender cannot make, which derenders in
    process: an answer made per engine step (`OpenAIRequest.per_step`: completions /derender
    leaves out the output ids it reads), and beam search's (its text is decoded whole, as
    native's beam search decodes it; /derender only detokenizes ids)."""

    def __init__(self, sidecar: Derenderer, in_process: Derenderer) -> None:
        self._sidecar = sidecar
        self._in_process = in_process

    def _for(self, request: TokenizedRequest) -> Derenderer:
        in_process = request.request.per_step or request.request.beam_search
        return self._in_process if in_process else self._sidecar

    def stream(self, request: TokenizedRequest, prompt_index: int = 0) -> StreamSession:
        return self._for(request).stream(request, prompt_index)

    async def whole(self, request: TokenizedRequest, generate_body: bytes, prompt_index: int = 0) -> bytes:
        return await self._for(request).whole(request, generate_body, prompt_index)


class MeasuredDerender:
    """Whole answers timed for the request's record (stream chunks are timed where they are
    framed: `StreamDerender`, and the relay's steps)."""

    def __init__(self, inner: Derenderer) -> None:
        self._inner = inner

    def stream(self, request: TokenizedRequest, prompt_index: int = 0) -> StreamSession:
        return self._inner.stream(request, prompt_index)

    async def whole(self, request: TokenizedRequest, generate_body: bytes, prompt_index: int = 0) -> bytes:
        started, record = time.perf_counter(), current()
        try:
            body = await self._inner.whole(request, generate_body, prompt_index)
        except GatewayError as error:
            if record is not None:
                record.answer_failed(error.code)
            raise
        if record is not None:
            record.derendered(started)
            usage = orjson.loads(body).get("usage") or {}
            record.completion_tokens += int(usage.get("completion_tokens") or 0)
        return body


def build_derenderer(
    config: TitoConfig, client: DerenderClient, model: DerenderModel, codec: TokenCodec | None = None
) -> Derenderer:
    """The configured backend. `model`: the engines' tokenizer (vLLM, torch: seconds), loaded
    at start-up, never on a request; the sidecar mode uses it only for its corrections."""
    backend: Derenderer = InProcessDerender(model)
    if config.derender.mode == "sidecar":
        backend = SidecarWhereItCan(SidecarDerender(client, model), backend)
    return MeasuredDerender(backend if codec is None else SemanticDerender(backend, codec))


class StreamDerender:
    """One prompt's generate SSE stream in, OpenAI SSE out."""

    def __init__(self, session: StreamSession) -> None:
        self._session = session
        self._framer = SSEFramer()
        self.done = False
        self._record = current()
        self._chunks = 0

    async def feed(self, raw: bytes) -> bytes:
        return await self._events(self._framer.feed(raw))

    async def whole(self, generate_body: bytes) -> bytes:
        """A whole generate answer (`TokenizedRequest.generate_streams` false) as the client's
        entire stream: the events it stands for, then the one `[DONE]`."""
        try:
            events = whole_events(generate_response(generate_body))
        except GatewayError as error:
            return self._fail(error)
        return await self._steps([(event, b"") for event in events]) + await self.finish()

    async def finish(self) -> bytes:
        """End of the generate stream: whatever is left, and the one `[DONE]`."""
        out = await self._events(self._framer.flush())
        if not self.done:
            self.done = True
            out += DONE_EVENT
        if self._record is not None:
            self._record.completion_tokens += self._session.completion_tokens
        return out

    async def _events(self, payloads: list[bytes]) -> bytes:
        """Everything that arrived together goes to the session in one call, so a backend
        can answer it with fewer chunks (backpressure); [DONE] or an error ends it."""
        out = bytearray()
        waiting: list[tuple[dict[str, Any], bytes]] = []
        for payload in payloads:
            if self.done:
                break
            event = parse_event(payload)
            if isinstance(event, dict):
                waiting.append((event, payload))
                continue
            out += await self._steps(waiting)
            waiting = []
            if self.done:
                break
            if event is None:
                self.done = True
                out += DONE_EVENT
            else:
                out += self._fail(event)
        if waiting and not self.done:
            out += await self._steps(waiting)
        return bytes(out)

    async def _steps(self, events: list[tuple[dict[str, Any], bytes]]) -> bytes:
        """Generate events (parsed, with their payloads) -> SSE bytes; a failure is an error event."""
        if not events:
            return b""
        self._chunks += 1
        record = self._record if self._chunks % CHUNK_SAMPLE == 1 else None
        started = time.perf_counter() if record is not None else 0.0
        try:
            out = await self._session.steps(events)
        except GatewayError as exc:
            return self._fail(exc)
        if record is not None:
            record.derendered(started)
        return out

    def _fail(self, error: GatewayError) -> bytes:
        self.done = True
        if self._record is not None:
            self._record.answer_failed(error.code)
        return sse_event(error.body) + DONE_EVENT


def whole_events(generate: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole GenerateResponse as the stream events it stands for: every choice's output in
    one step (with the prompt's logprobs, which only a whole answer carries), then the usage."""
    events = [{key: value for key, value in generate.items() if key != "usage"}]
    if generate.get("usage") is not None:
        events.append({"choices": [], "usage": generate["usage"]})
    return events


def parse_event(payload: bytes) -> dict[str, Any] | GatewayError | None:
    """One generate SSE payload, parsed once: an event, None for `[DONE]`, or the error it
    means (an in-band engine error: the engine's own error object, which is what native
    serving streams for it, type, message and code kept; anything else: 502)."""
    if payload == DONE:
        return None
    try:
        event = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return GatewayError(502, "engine sent an invalid stream event", code="engine_invalid_event")
    if not isinstance(event, dict):
        return GatewayError(502, "engine sent an invalid stream event", code="engine_invalid_event")
    if "error" not in event:
        return event
    error = event["error"]
    if not (isinstance(error, dict) and isinstance(error.get("message"), str) and error.get("type")):
        message = str(error.get("message") if isinstance(error, dict) else error)
        return GatewayError(500, message or "engine error", code="engine_error")
    code = error.get("code")
    status = code if isinstance(code, int) and 400 <= code < 600 else 500
    return GatewayError(status, error["message"], code=code, body=orjson.dumps({"error": error}))
