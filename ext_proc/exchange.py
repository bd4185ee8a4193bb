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
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from uuid import uuid4

import httpx

from ext_proc.config import TitoConfig
from ext_proc.derender import Derenderer, StreamDerender
from ext_proc.envoy_messages import (
    ATTEMPT_COUNT_HEADER,
    DESTINATION_KEY,
    HIDDEN_RESPONSE_HEADERS,
    JSON,
    UPSTREAM_HOST_HEADER,
    Headers,
    header_map,
    local_response,
    request_body_replies,
    request_headers_reply,
    request_trailers_reply,
    response_body_reply,
    response_headers_reply,
    response_trailers_reply,
)
from ext_proc.errors import GatewayError, normalize_error_body
from ext_proc.http_client import CountingTransport
from ext_proc.loop_lag import LoopLag
from ext_proc.native import replay_native, token_only_unsupported
from ext_proc.openai_api import is_multi_prompt, parse_request, requested_completion_tokens
from ext_proc.protocol import GENERATE_PATH, ApiKind, OpenAIRequest, TokenizedRequest
from ext_proc.token_only import generate_body, requested_max_tokens
from ext_proc.tokenization import TokenizationService
from protos.stubs import ext_proc_pb
from scheduler import ContextOverflow, Decision, Rejection, Scheduler, ScheduleRequest, clamp_max_tokens


@dataclass
class Services:
    """What every stream of one processor process shares."""

    config: TitoConfig
    tokenization: TokenizationService
    derender: Derenderer
    scheduler: Scheduler
    http: httpx.AsyncClient
    http_streams: CountingTransport
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
        self._body = bytearray()
        self._body_bytes = 0
        self._response_body = bytearray()
        # Our own id, never a client's: it keys the token ledger and the engine's request.
        self._request_id = uuid4().hex
        self._request: OpenAIRequest | None = None
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
        async for reply in replies:
            yield reply

    # -- request path -------------------------------------------------------------------

    async def _on_request_headers(self, message: ext_proc_pb.HttpHeaders) -> Replies:
        self._request_headers = header_map(message)
        method = self._request_headers.get(":method", "")
        self._api = ApiKind.from_path(method, self._request_headers.get(":path", ""))
        if self._api is None:
            self.mode = Mode.PASSTHROUGH
            try:
                yield self._native_headers(self._schedule(ScheduleRequest(self._request_id, [], 0)))
            except GatewayError:  # no instance admissible: not token work, let Envoy pick
                yield request_headers_reply(remove=(DESTINATION_KEY,))
        elif message.end_of_stream:
            async for reply in self._answer(GatewayError(400, "request body is required", code="missing_body")):
                yield reply

    async def _on_request_body(self, message: ext_proc_pb.HttpBody) -> Replies:
        if self.mode is Mode.PASSTHROUGH:
            for reply in request_body_replies(message.body, message.end_of_stream):
                yield reply
            return
        if self.mode is not Mode.PENDING:  # duplicate end_of_stream (envoy#46237) or late data
            return
        limit = self._services.config.listener.max_request_bytes
        self._body_bytes += len(message.body)
        if self._body_bytes <= limit:
            self._body += message.body
        elif self._body:
            self._body = bytearray()  # over the limit: drop it, keep reading to the end
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
        try:
            config = self._services.config
            # Answered only now that the body ended: an answer before that still opens the upstream.
            if self._body_bytes > config.listener.max_request_bytes:
                limit = config.listener.max_request_bytes
                raise GatewayError(413, f"request body exceeds {limit} bytes", code="request_too_large")
            request = parse_request(
                self._api, self._request_headers.get("content-type"), bytes(self._body), config.model
            )
            self._request = request
            if is_multi_prompt(request):
                # Multi-prompt fan-out is processor-owned work still to come; the engine's
                # own OpenAI endpoint answers correctly meanwhile.
                replies = self._route_native(request, self._schedule(ScheduleRequest(self._request_id, [], 0)))
            else:
                tokenized = await self._services.tokenization.tokenize(request, self._request_id)
                replies = self._route(tokenized)
        except GatewayError as error:
            async for reply in self._answer(error):
                yield reply
            return
        for reply in replies:
            if reply.HasField("request_body") and not end_of_stream:  # trailers will end the body
                reply.request_body.response.body_mutation.streamed_response.end_of_stream = False
            yield reply

    def _route(self, tokenized: TokenizedRequest) -> list[ext_proc_pb.ProcessingResponse]:
        prompt = tokenized.prompts[0]
        prompt_len = len(prompt.token_ids)
        if tokenized.complete:
            max_tokens = self._budgeted_max_tokens(prompt_len, requested_max_tokens(prompt))
        else:  # the engine will apply the request's own limit on the native path
            max_tokens = requested_completion_tokens(
                tokenized.request, self._services.config.model.max_model_len - prompt_len
            )
        decision = self._schedule(ScheduleRequest(tokenized.request_id, prompt.token_ids, max_tokens))
        if not tokenized.complete or not self._services.scheduler.supports_token_only(decision.instance.address):
            return self._route_native(tokenized.request, decision)
        self._tokenized = tokenized
        self.mode = Mode.ROUTED
        headers = request_headers_reply(
            set_headers={":path": GENERATE_PATH, "content-type": JSON, "x-request-id": tokenized.request_id},
            remove=("content-length", DESTINATION_KEY),
            destination=",".join(decision.hosts),
        )
        return [headers, *request_body_replies(generate_body(prompt, max_tokens, tokenized.api))]

    def _route_native(self, request: OpenAIRequest, decision: Decision) -> list[ext_proc_pb.ProcessingResponse]:
        """The original OpenAI body to the engine's own endpoint; its response passes through."""
        self.mode = Mode.PASSTHROUGH
        return [self._native_headers(decision), *request_body_replies(request.raw)]

    def _native_headers(self, decision: Decision) -> ext_proc_pb.ProcessingResponse:
        return request_headers_reply(remove=(DESTINATION_KEY,), destination=",".join(decision.hosts))

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
                self._response_done = True
            if out or message.end_of_stream:
                yield response_body_reply(out, message.end_of_stream)
        elif self.mode in (Mode.BUFFERED, Mode.ERROR):
            self._response_body += message.body
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
        upstream = bytes(self._response_body)
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
        assert self._decision is not None and self._request is not None
        address = self._served_by or self._decision.instance.address
        self._services.scheduler.mark_token_only_unsupported(address)
        self._services.native_replays += 1
        idle_s = self._services.config.listener.stream_idle_timeout_s
        async for reply in replay_native(self._services.http, address, self._request, idle_s, end_of_stream):
            yield reply
