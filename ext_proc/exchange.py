"""One Envoy HTTP stream, message by message: the processor's per-stream state machine.

Request path (FULL_DUPLEX_STREAMED): the request-headers reply is held back until the body
is complete, then the request is rendered, scheduled and rewritten into a token-only
generate body routed by `envoy.lb` metadata, or answered by the processor itself
(errors). Response path: SSE goes chunk by chunk through streaming derender; JSON is
collected and derendered once; non-2xx and Envoy's own replies become OpenAI errors.
Anything that is not an OpenAI API tito renders passes through untouched.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass
from uuid import uuid4

from ext_proc.config import TitoConfig
from ext_proc.derender import DerenderClient, StreamDerender, derender_response
from ext_proc.envoy_messages import (
    DESTINATION_KEY,
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
from ext_proc.openai_api import is_multi_prompt, parse_request
from ext_proc.protocol import GENERATE_PATH, ApiKind, OpenAIRequest, TokenizedRequest
from ext_proc.render import RenderClient
from ext_proc.token_only import generate_body, max_tokens
from protos.stubs import ext_proc_pb
from scheduler import ScheduleRequest, Scheduler

JSON = "application/json"


@dataclass
class Services:
    """What every stream of one processor process shares."""

    config: TitoConfig
    render: RenderClient
    derender: DerenderClient
    scheduler: Scheduler


class Mode(enum.Enum):
    PENDING = "pending"  # request not complete yet
    PASSTHROUGH = "passthrough"  # not ours: bodies echoed unchanged
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
        self._response_body = bytearray()
        self._request_id = ""
        self._tokenized: TokenizedRequest | None = None
        self._derender: StreamDerender | None = None
        self._status = 200
        self._response_done = False

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
        self._request_id = self._request_headers.get("x-request-id") or uuid4().hex
        method = self._request_headers.get(":method", "")
        self._api = ApiKind.from_path(method, self._request_headers.get(":path", ""))
        if self._api is None:
            self.mode = Mode.PASSTHROUGH
            yield self._route_unchanged()
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
        self._body += message.body
        limit = self._services.config.listener.max_request_bytes
        if len(self._body) > limit:
            error = GatewayError(413, f"request body exceeds {limit} bytes", code="request_too_large")
            async for reply in self._answer(error):
                yield reply
        elif message.end_of_stream:
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
            request = parse_request(
                self._api, self._request_headers.get("content-type"), bytes(self._body), self._services.config.model
            )
            if is_multi_prompt(request):
                # Multi-prompt fan-out is processor-owned work still to come; the engine's
                # own OpenAI endpoint answers correctly meanwhile.
                self.mode = Mode.PASSTHROUGH
                yield self._route_unchanged()
                for reply in request_body_replies(request.raw, end_of_stream):
                    yield reply
                return
            replies = await self._route_token_only(request, end_of_stream)
        except GatewayError as error:
            async for reply in self._answer(error):
                yield reply
            return
        for reply in replies:
            yield reply

    async def _route_token_only(self, request: OpenAIRequest, end_of_stream: bool) -> list[ext_proc_pb.ProcessingResponse]:
        tokenized = await self._services.render.render(request, self._request_id)
        prompt = tokenized.prompts[0]
        decision = self._services.scheduler.schedule(ScheduleRequest(prompt.token_ids, max_tokens(prompt)))
        body = generate_body(prompt)
        self._tokenized = tokenized
        self.mode = Mode.ROUTED
        headers = request_headers_reply(
            set_headers={":path": GENERATE_PATH, "content-type": JSON, "x-request-id": tokenized.request_id},
            remove=("content-length", DESTINATION_KEY),
            destination=decision.instance.address,
        )
        return [headers, *request_body_replies(body, end_of_stream)]

    def _route_unchanged(self) -> ext_proc_pb.ProcessingResponse:
        decision = self._services.scheduler.schedule(ScheduleRequest([], 0))
        return request_headers_reply(remove=(DESTINATION_KEY,), destination=decision.instance.address)

    async def _answer(self, error: GatewayError) -> Replies:
        self.mode = Mode.LOCAL
        for reply in local_response(error.status, error.body):
            yield reply

    # -- response path ------------------------------------------------------------------

    async def _on_response_headers(self, message: ext_proc_pb.HttpHeaders) -> Replies:
        if self.mode is not Mode.ROUTED:
            yield response_headers_reply()
            return
        headers = header_map(message)
        self._status = int(headers.get(":status", "502"))
        content_type = headers.get("content-type", "")
        assert self._tokenized is not None
        if self._status == 200 and self._tokenized.stream and content_type.startswith("text/event-stream"):
            self.mode = Mode.STREAM
            self._derender = StreamDerender(self._services.derender, self._tokenized)
            yield response_headers_reply(remove=("content-length",))
        else:
            self.mode = Mode.BUFFERED if self._status == 200 else Mode.ERROR
            if message.end_of_stream:
                async for reply in self._finish_buffered(end_of_stream=True):
                    yield reply
            # otherwise the headers reply waits for the whole body: its status may change

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
        status = self._status
        if self.mode is Mode.BUFFERED:
            try:
                body = await derender_response(self._services.derender, self._tokenized, upstream)
            except GatewayError as error:
                status, body = error.status, error.body
        else:
            body = normalize_error_body(status, upstream)
        yield response_headers_reply(
            set_headers={":status": str(status), "content-type": JSON}, remove=("content-length",)
        )
        yield response_body_reply(body, end_of_stream)
