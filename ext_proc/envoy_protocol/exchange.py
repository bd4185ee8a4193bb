"""One Envoy HTTP stream, message by message: the processor's per-stream state machine.

Request path (FULL_DUPLEX_STREAMED): the request-headers reply is held back until the body
is complete. Then the request is tokenized (render, or the local tokenizer when render
fails), admitted and scheduled on those ids, and either rewritten into a token-only generate
body or sent down the native path (original OpenAI body) — both routed by `envoy.lb`
metadata — or answered by the processor itself (errors, 429).
Response path: SSE goes chunk by chunk through streaming derender; JSON is collected and
derendered once; non-2xx and Envoy's own replies become OpenAI errors; an engine without
token-only generate (404/501, nothing sent yet) gets the request once more on its native
endpoint. Anything that is not an OpenAI API tito renders passes through untouched.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from uuid import uuid4

import httpx

from ext_proc.byte_budget import ByteBudget, StreamBytes
from ext_proc.config import TitoConfig
from ext_proc.derender.pipeline import Derenderer, StreamDerender
from ext_proc.derender.streaming import DONE_EVENT, sse_event
from ext_proc.envoy_protocol.messages import (
    ATTEMPT_COUNT_HEADER,
    DESTINATION_KEY,
    HIDDEN_RESPONSE_HEADERS,
    JSON,
    UPSTREAM_HOST_HEADER,
    Headers,
    header_map,
    immediate_response,
    local_response,
    request_body_replies,
    request_headers_reply,
    request_trailers_reply,
    response_body_reply,
    response_headers_reply,
    response_trailers_reply,
    unforwarded_headers,
)
from ext_proc.errors import GatewayError, error_body, normalize_error_body
from ext_proc.frontend.openai_api import parse_request, requested_completion_tokens
from ext_proc.frontend.token_only import generate_body, requested_max_tokens
from ext_proc.frontend.tokenization import TokenizationService
from ext_proc.legs.http_client import CountingTransport
from ext_proc.legs.native import native_body, replay_native, token_only_unsupported
from ext_proc.loop_lag import LoopLag
from ext_proc.model_files import vocab_size
from ext_proc.protocol import GENERATE_PATH, ApiKind, PromptTokens, TokenizedRequest
from protos.stubs import ext_proc_pb
from scheduler import ContextOverflow, Decision, Rejection, Scheduler, ScheduleRequest, clamp_max_tokens

log = logging.getLogger("tito.exchange")


@dataclass
class Services:
    """What every stream of one processor process shares."""

    config: TitoConfig
    tokenization: TokenizationService
    derender: Derenderer
    scheduler: Scheduler
    http: httpx.AsyncClient
    http_streams: CountingTransport
    inflight: ByteBudget
    loop_lag: LoopLag = field(default_factory=LoopLag)
    active_exchanges: int = 0
    native_replays: int = 0


class Mode(enum.Enum):
    PENDING = "pending"  # request not complete yet
    PASSTHROUGH = "passthrough"  # native path / not ours: bodies pass unchanged
    LOCAL = "local"  # the processor answered; Envoy sends nothing more
    ROUTED = "routed"  # token-only request sent upstream
    STREAM = "stream"  # routed, upstream answered SSE
    BUFFERED = "buffered"  # routed, upstream answered JSON: derender at the end
    ERROR = "error"  # routed, upstream answered non-2xx


Replies = AsyncIterator[ext_proc_pb.ProcessingResponse]


class Exchange:
    def __init__(self, services: Services) -> None:
        self._services = services
        self.mode = Mode.PENDING
        self._api: ApiKind | None = None
        self._request_headers: Headers = {}
        # Pieces as they came (joined once at the end: no re-allocation while a body grows)
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._response_body: list[bytes] = []
        self._response_bytes = 0
        self._held = StreamBytes(services.inflight)  # request/response bytes this stream buffers
        # Our own id, never a client's: it keys the token ledger and the engine's request.
        self._request_id = uuid4().hex
        self._tokenized: TokenizedRequest | None = None
        self._derender: StreamDerender | None = None
        self._status = 200
        self._response_done = False
        self._decision: Decision | None = None
        self._failed_hosts: list[str] = []
        self._served_by: str | None = None
        self._closed = False
        services.active_exchanges += 1

    def close(self) -> None:
        """Every exit path (done, error, client gone): release the request's tokens and
        report what the engines did to their breakers."""
        if self._closed:
            return
        self._closed = True
        self._services.active_exchanges -= 1
        self._held.release()
        if self._decision is not None:
            self._services.scheduler.finish(
                self._decision.request_id, time.monotonic(), self._failed_hosts, self._served_by
            )

    async def on_message(self, message: ext_proc_pb.ProcessingRequest) -> Replies:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            replies = self._on_request_headers(message.request_headers)
        elif kind == "request_body":
            replies = self._on_request_body(message.request_body)
        elif kind == "request_trailers":
            replies = self._on_request_trailers()
        elif kind == "response_headers":
            replies = self._on_response_headers(message.response_headers)
        elif kind == "response_body":
            replies = self._on_response_body(message.response_body)
        elif kind == "response_trailers":
            replies = self._on_response_trailers()
        else:
            return
        try:
            async for reply in replies:
                yield reply
        except Exception:
            # A processor bug: the client gets a generic 500, the log has the details.
            log.exception("request %s: processor error on %s (mode %s)", self._request_id, kind, self.mode.value)
            for reply in self._internal_error():
                yield reply

    def _internal_error(self) -> list[ext_proc_pb.ProcessingResponse]:
        if self._response_done or self.mode is Mode.LOCAL:
            return []
        message = f"internal gateway error (request {self._request_id})"
        if self.mode is Mode.STREAM:  # the client has the headers: end its stream with an error event
            self._response_done = True
            return [response_body_reply(sse_event(error_body(500, message, code="internal_error")) + DONE_EVENT, True)]
        return [self._reject(GatewayError(500, message, code="internal_error"))]

    def _reject(self, error: GatewayError) -> ext_proc_pb.ProcessingResponse:
        """Answer now, whatever has arrived: no upstream is opened (or it is dropped), the
        rest of the request is not read, and the bytes held so far are let go."""
        self.mode = Mode.LOCAL
        self._response_done = True
        self._body, self._response_body = [], []
        self._held.release()
        return immediate_response(error.status, error.body)

    # -- request path -------------------------------------------------------------------

    async def _on_request_headers(self, message: ext_proc_pb.HttpHeaders) -> Replies:
        self._request_headers = headers = header_map(message)
        listener = self._services.config.listener
        handler = listener.handler(headers.get(":method", ""), headers.get(":path", ""))
        if handler is None:  # Envoy's route table answers these itself; never forward one
            yield self._reject(GatewayError(404, "not found", code="not_found"))
        elif handler == "health":
            self.mode = Mode.LOCAL
            yield immediate_response(200, b'{"status":"ok"}')
        elif handler == "passthrough":
            # Not inference: no lease, no half-open probe, and its outcome is no breaker input.
            self.mode = Mode.PASSTHROUGH
            hosts = self._services.scheduler.passthrough_hosts()
            yield request_headers_reply(remove=self._unforwarded(), destination=",".join(hosts))
        else:
            self._api = ApiKind.from_handler(handler)
            declared = headers.get("content-length", "")
            if declared.isdigit() and int(declared) > listener.max_request_bytes:
                yield self._reject(self._too_large())
            elif message.end_of_stream:
                async for reply in self._answer(GatewayError(400, "request body is required", code="missing_body")):
                    yield reply

    def _unforwarded(self, *also: str) -> tuple[str, ...]:
        """Request headers removed before the upstream: all but the forwarded few."""
        return (*also, DESTINATION_KEY, *unforwarded_headers(self._request_headers))

    def _too_large(self) -> GatewayError:
        limit = self._services.config.listener.max_request_bytes
        return GatewayError(413, f"request body exceeds {limit} bytes", code="request_too_large")

    async def _on_request_body(self, message: ext_proc_pb.HttpBody) -> Replies:
        if self.mode is Mode.PASSTHROUGH:
            for reply in request_body_replies(message.body, message.end_of_stream):
                yield reply
            return
        if self.mode is not Mode.PENDING:  # duplicate end_of_stream (envoy#46237) or late data
            return
        # Enforced as the bytes arrive: an endless upload is cut off at the limit.
        piece = message.body  # a copy per access: read once
        self._body_bytes += len(piece)
        if self._body_bytes > self._services.config.listener.max_request_bytes:
            yield self._reject(self._too_large())
            return
        if not self._held.take(len(piece)):
            yield self._reject(GatewayError(503, "the gateway is out of request buffer space", code="overloaded"))
            return
        self._body.append(piece)
        if message.end_of_stream:
            async for reply in self._dispatch(end_of_stream=True):
                yield reply

    async def _on_request_trailers(self) -> Replies:
        if self.mode is Mode.PENDING:  # trailers, not end_of_stream, ended the body
            async for reply in self._dispatch(end_of_stream=False):
                yield reply
        if self.mode is not Mode.LOCAL:
            yield request_trailers_reply()

    async def _dispatch(self, end_of_stream: bool) -> Replies:
        assert self._api is not None
        raw, self._body = b"".join(self._body), []
        self._held.release()  # parsed once below; the raw bytes are not kept
        try:
            config = self._services.config
            request = parse_request(
                self._api, self._request_headers.get("content-type"), raw, config.model, vocab_size(config.model.path)
            )
            tokenized = await self._services.tokenization.tokenize(request, raw, self._request_id)
            replies = self._route(tokenized, raw)
        except GatewayError as error:
            async for reply in self._answer(error):
                yield reply
            return
        for reply in replies:
            if reply.HasField("request_body") and not end_of_stream:  # trailers will end the body
                reply.request_body.response.body_mutation.streamed_response.end_of_stream = False
            yield reply

    def _route(self, tokenized: TokenizedRequest, raw: bytes) -> list[ext_proc_pb.ProcessingResponse]:
        decision = self._schedule(self._schedule_request(tokenized))
        if (
            len(tokenized.prompts) > 1  # multi-prompt fan-out is processor-owned work still to come
            or not tokenized.complete
            or not self._services.scheduler.supports_token_only(decision.instance.address)
        ):
            self.mode = Mode.PASSTHROUGH  # the engine's own endpoint answers; its response passes through
            headers = request_headers_reply(remove=self._unforwarded(), destination=",".join(decision.hosts))
            return [headers, *request_body_replies(native_body(tokenized.request, raw))]
        self._tokenized = replace(tokenized, request=tokenized.request.kept())  # no metadata for the stream's life
        self.mode = Mode.ROUTED
        prompt = tokenized.prompts[0]
        set_headers = {":path": GENERATE_PATH, "content-type": JSON, "x-request-id": tokenized.request_id}
        headers = request_headers_reply(
            set_headers=set_headers,
            remove=[h for h in self._unforwarded("content-length") if h not in set_headers],
            destination=",".join(decision.hosts),
        )
        max_tokens = self._max_tokens(tokenized, prompt)
        return [headers, *request_body_replies(generate_body(prompt, max_tokens, tokenized.api))]

    def _schedule_request(self, tokenized: TokenizedRequest) -> ScheduleRequest:
        """Admission charges every prompt of the batch and n × max_tokens for each; the
        first prompt's ids drive instance choice."""
        first, *rest = tokenized.prompts
        n = tokenized.n
        others = sum(len(p.token_ids) + n * self._max_tokens(tokenized, p) for p in rest)
        return ScheduleRequest(tokenized.request_id, first.token_ids, self._max_tokens(tokenized, first), n, others)

    def _max_tokens(self, tokenized: TokenizedRequest, prompt: PromptTokens) -> int:
        prompt_len = len(prompt.token_ids)
        if tokenized.complete:
            return self._budgeted_max_tokens(prompt_len, requested_max_tokens(prompt))
        # the engine will apply the request's own limit on the native path
        return requested_completion_tokens(tokenized.request, self._services.config.model.max_model_len - prompt_len)

    def _budgeted_max_tokens(self, prompt_tokens: int, max_tokens: int) -> int:
        config = self._services.config
        if config.scheduler.context_budget_mode != "on":
            return max_tokens
        try:
            return clamp_max_tokens(prompt_tokens, max_tokens, config.model.max_model_len)
        except ContextOverflow as exc:
            raise GatewayError(400, str(exc), param="messages", code="context_length_exceeded") from exc

    def _schedule(self, request: ScheduleRequest) -> Decision:
        outcome = self._services.scheduler.schedule(request, time.monotonic())
        if isinstance(outcome, Rejection):
            code = "token_budget_exceeded" if outcome.status == 429 else "no_healthy_instance"
            raise GatewayError(outcome.status, outcome.reason, code=code)
        self._decision = outcome
        return outcome

    async def _answer(self, error: GatewayError) -> Replies:
        self.mode = Mode.LOCAL
        for reply in local_response(error.status, error.body):
            yield reply

    # -- response path ------------------------------------------------------------------

    async def _on_response_headers(self, message: ext_proc_pb.HttpHeaders) -> Replies:
        headers = header_map(message)
        self._engine_verdict(headers)
        if self.mode is not Mode.ROUTED:
            yield response_headers_reply(remove=HIDDEN_RESPONSE_HEADERS[1:])
            return
        self._status = int(headers.get(":status", "502"))
        content_type = headers.get("content-type", "")
        assert self._tokenized is not None
        if self._status == 200 and self._tokenized.stream and content_type.startswith("text/event-stream"):
            self.mode = Mode.STREAM
            self._derender = StreamDerender(self._services.derender.stream(self._tokenized))
            yield response_headers_reply(remove=HIDDEN_RESPONSE_HEADERS)
        else:
            self.mode = Mode.BUFFERED if self._status == 200 else Mode.ERROR
            if message.end_of_stream:
                async for reply in self._finish_buffered(end_of_stream=True):
                    yield reply
            # otherwise the headers reply waits for the whole body: its status may change

    def _engine_verdict(self, headers: Headers) -> None:
        """Which engines failed this request and which answered, from what Envoy reports:
        hosts are tried in override_host order, one per attempt."""
        if self._decision is None:
            return
        hosts = self._decision.hosts
        attempts = min(int(headers.get(ATTEMPT_COUNT_HEADER, "1") or 1), len(hosts))
        upstream = headers.get(UPSTREAM_HOST_HEADER, "")
        status = int(headers.get(":status", "0") or 0)
        if upstream in hosts:
            self._failed_hosts = list(hosts[: hosts.index(upstream)])
            if status >= 500:
                self._failed_hosts.append(upstream)
            else:
                self._served_by = upstream
        elif status in (502, 503, 504):  # Envoy's own reply: every attempt failed
            self._failed_hosts = list(hosts[:attempts])

    async def _on_response_body(self, message: ext_proc_pb.HttpBody) -> Replies:
        if self._response_done:
            return
        if self.mode is Mode.STREAM:
            assert self._derender is not None
            out = await self._derender.feed(message.body)
            if message.end_of_stream:
                out += await self._derender.finish()
            # [DONE] or a failure ends the client's response; ending it early also ends the
            # upstream stream, so an engine never generates for nobody.
            end = message.end_of_stream or self._derender.done
            self._response_done = end
            if out or end:
                yield response_body_reply(out, end)
        elif self.mode in (Mode.BUFFERED, Mode.ERROR):
            piece = message.body
            cap = self._services.config.processor.max_response_bytes
            self._response_bytes += len(piece)
            if self._response_bytes > cap:
                error = GatewayError(502, f"engine response exceeds {cap} bytes", code="engine_response_too_large")
                yield self._reject(error)
                return
            if not self._held.take(len(piece)):
                yield self._reject(GatewayError(503, "the gateway is out of response buffer space", code="overloaded"))
                return
            self._response_body.append(piece)
            if message.end_of_stream:
                async for reply in self._finish_buffered(end_of_stream=True):
                    yield reply
        else:
            yield response_body_reply(message.body, message.end_of_stream)

    async def _on_response_trailers(self) -> Replies:
        if not self._response_done:
            if self.mode is Mode.STREAM:
                assert self._derender is not None
                yield response_body_reply(await self._derender.finish(), False)
                self._response_done = True
            elif self.mode in (Mode.BUFFERED, Mode.ERROR):
                async for reply in self._finish_buffered(end_of_stream=False):
                    yield reply
        yield response_trailers_reply()

    async def _finish_buffered(self, end_of_stream: bool) -> Replies:
        assert self._tokenized is not None
        self._response_done = True
        upstream, self._response_body = b"".join(self._response_body), []
        self._held.release()
        if self.mode is Mode.ERROR and token_only_unsupported(self._status, upstream):
            async for reply in self._replay_native(end_of_stream):
                yield reply
            return
        status = self._status
        if self.mode is Mode.BUFFERED:
            try:
                body = await self._services.derender.whole(self._tokenized, upstream)
            except GatewayError as error:
                status, body = error.status, error.body
        else:
            body = normalize_error_body(status, upstream)
        yield response_headers_reply(
            set_headers={":status": str(status), "content-type": JSON}, remove=HIDDEN_RESPONSE_HEADERS
        )
        yield response_body_reply(body, end_of_stream)

    async def _replay_native(self, end_of_stream: bool) -> Replies:
        """The engine has no token-only generate and sent nothing yet: the same request once
        more on its native endpoint, from the processor; remembered for that instance."""
        assert self._decision is not None and self._tokenized is not None
        address = self._served_by or self._decision.instance.address
        self._services.scheduler.mark_token_only_unsupported(address)
        self._services.native_replays += 1
        idle_s = self._services.config.listener.stream_idle_timeout_s
        async for reply in replay_native(self._services.http, address, self._tokenized.request, idle_s, end_of_stream):
            yield reply
