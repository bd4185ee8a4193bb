"""One Envoy HTTP stream: the ext_proc protocol adapter. The request-headers reply is held
until the body has ended; the planner's `Plan` then becomes messages (a Handoff's prefill
leg runs first), and a response handler (`response_handlers.py`) turns the engine's response
into the client's. The stream's tasks and outbox: `stream.py`."""

from __future__ import annotations

import enum
from functools import partial
from typing import Any
from uuid import uuid4

from ext_proc.byte_budget import StreamBytes
from ext_proc.envoy_protocol import epp
from ext_proc.envoy_protocol import messages as msg
from ext_proc.envoy_protocol.owned import OwnedAnswer
from ext_proc.envoy_protocol.request_body import RequestBody, too_large
from ext_proc.envoy_protocol.stream import EnvoyStream, Replies
from ext_proc.envoy_protocol.verdicts import Verdict, engine_verdict
from ext_proc.errors import GatewayError
from ext_proc.planning.plan import Local, Native, Owned, Passthrough, Plan, TokenOnly, lease_ids, routed
from ext_proc.protocol import Flow
from ext_proc.response_handlers import Chunk, ConvertedResponse, Refuse, ResponseHandler, handler_for, refusal
from ext_proc.services import Services
from protos.stubs import ext_proc_pb


class Mode(enum.Enum):
    PENDING = "pending"  # the request body is still arriving
    LOCAL = "local"  # answered here: no more messages
    FORWARD = "forward"  # passthrough: request and response bodies go unchanged
    PLANNED = "planned"  # sent upstream as planned; a response handler takes the response
    OWNED = "owned"  # the processor streams its own answer from engine streams it runs


class Exchange(EnvoyStream):
    def __init__(self, services: Services) -> None:
        self.request_id = uuid4().hex  # ours, never a client's (clients get it as x-request-id)
        super().__init__(services.observability.begin(self.request_id))
        self._s = services
        self.mode = Mode.PENDING
        self._headers: msg.Headers = {}
        self._route: str | None = None  # the route's handler: chat, completions, messages, ...
        self._held = StreamBytes(services.inflight)
        self._body = RequestBody(services.config.listener.max_request_bytes, self._held)
        self.plan: Plan | None = None  # (flow control finds a request to evict by its legs' leases)
        self._leases: list[str] = []
        self._handler: ResponseHandler | None = None
        self._owned: OwnedAnswer | None = None
        self._verdict = Verdict()
        self._gateway = epp.Gateway()  # what the proxy in front sends and allows
        self._flow: Flow | GatewayError = Flow()  # whose share it takes (flow control)
        self._response_head: msg.Headers = {}  # the engine's response headers
        services.process.active_exchanges += 1
        services.process.live.add(self)

    @property
    def answered(self) -> bool:
        return self.mode is Mode.LOCAL

    def release(self) -> None:
        """Leases back with what the engines did (the routed leg's verdict), bytes let go."""
        self.record.mark("records")
        routed_lease = routed(self.plan)[0]
        self._s.triggers.forget(routed_lease or "")
        self.record.leg_done(routed_lease or "", self._verdict.served_by, self._verdict.failed)
        self.record.finish(cancelled=not self.record.complete)
        for lease in self._leases:
            verdict = self._verdict if lease == routed_lease else Verdict()
            self._s.planner.finish(lease, verdict.failed, verdict.served_by)
        if self._owned is not None:
            self._owned.fanout.release()
        if isinstance(self._handler, ConvertedResponse):
            self._handler.close()
        self._held.release()
        self._s.process.active_exchanges -= 1

    async def on_message(self, message: ext_proc_pb.ProcessingRequest) -> Replies:
        kind = message.WhichOneof("request")  # request_headers, request_body, ..., response_trailers
        self.record.envoy_message(kind)
        untouched = self._gateway.read(message, self.record)  # (a gateway keeping the answer: its reply)
        if kind == "response_headers":  # who served: breakers, admission and native replays learn it
            self._response_head = head = msg.header_map(message.response_headers)
            self._verdict = engine_verdict(routed(self.plan)[1], head, self._gateway.served)
        if untouched is not None:
            yield untouched
        elif kind is not None and hasattr(self, f"_on_{kind}"):
            async for reply in getattr(self, f"_on_{kind}")(getattr(message, kind)):
                yield reply

    async def _on_request_headers(self, message: ext_proc_pb.HttpHeaders) -> Replies:
        self._headers = headers = msg.header_map(message)
        limit = self._s.config.listener.max_request_bytes
        handler = self._s.config.listener.handler(headers.get(":method", ""), headers.get(":path", ""))
        self.record.headers(handler, headers)
        self._flow = self._s.flow(handler or "", headers)  # its tenant, or why it has none (401)
        if self._s.process.draining:  # SIGTERM: open streams finish, new ones go elsewhere
            yield self._refuse(GatewayError(503, "the gateway is shutting down", code="draining"))
        elif handler is None:  # Envoy's route table answers these itself; never forward one
            yield self._refuse(GatewayError(404, "not found", code="not_found"))
        elif isinstance(self._flow, GatewayError):
            yield self._refuse(self._flow)
        elif self._s.answers_itself(handler):  # (no body: Envoy stops reading it)
            self.mode = Mode.LOCAL
            status, body = await self._s.answer(handler, headers, self._flow)
            yield msg.immediate_response(status, body, self.record)
        elif handler == "passthrough" and (refused := self._s.planner.refuses_passthrough(headers)) is not None:
            yield self._refuse(refused)
        elif handler == "passthrough" or not self._gateway.streams_request:
            yield self._passthrough(message.end_of_stream)
        elif int(headers.get("content-length", "0") or 0) > limit:
            yield self._refuse(too_large(limit))
        elif message.end_of_stream:  # no body: answered as native answers one (never planned)
            yield self._refuse(await self._s.bodiless(handler, headers.get("content-type")))
        else:
            self._route = handler

    def _passthrough(self, end_of_stream: bool) -> ext_proc_pb.ProcessingResponse:
        """Unplanned: an engine's own route, or an inference request whose body the gateway
        does not stream here (its headers cannot wait for it): the least busy engine of the
        gateway's subset gets it as it is (EPP protocol: none there, 503)."""
        plan = self._s.planner.passthrough(self._gateway.plane.within)
        if not plan.hosts and self._gateway.plane.within is not None:
            return self._refuse(GatewayError(503, "no engine instance in the request's endpoint subset"))
        self.plan, self.mode = plan, Mode.FORWARD
        self._forwarded(end_of_stream)
        return msg.request_headers_reply(remove=self._unforwarded(), destination=self._named(plan.hosts))

    async def _on_request_body(self, message: ext_proc_pb.HttpBody) -> Replies:
        if self.mode is Mode.FORWARD and not self._gateway.streams_request:  # (BUFFERED, STREAMED): as it is
            yield msg.request_body_unchanged()
            self._forwarded(message.end_of_stream)
        elif self.mode is Mode.FORWARD:
            for reply in msg.request_body_replies(message.body, message.end_of_stream):
                yield reply
            self._forwarded(message.end_of_stream)
        elif self.mode is Mode.PENDING:  # (not after an answer, nor a duplicate end_of_stream: envoy#46237)
            if (refused := self._body.add(message.body)) is not None:
                yield self._refuse(refused)
            elif message.end_of_stream:
                async for reply in self._dispatch(end_of_stream=True):
                    yield reply

    async def _on_request_trailers(self, _: ext_proc_pb.HttpTrailers) -> Replies:
        if self.mode is Mode.PENDING:  # trailers, not end_of_stream, ended the body
            async for reply in self._dispatch(end_of_stream=False):
                yield reply
        if self.mode in (Mode.FORWARD, Mode.PLANNED):
            yield msg.request_trailers_reply()
            self._forwarded(self.mode is Mode.FORWARD)

    def _forwarded(self, whole: bool) -> None:
        """A passthrough request, whole once sent on. The call stays open for the response:
        Envoy streams its body through here (FULL_DUPLEX), and a call ended meanwhile lost
        the chunks already sent, so clients got the engine's status with an empty body."""
        if whole:
            self.record.handed_off()

    async def _dispatch(self, end_of_stream: bool) -> Replies:
        assert self._route is not None
        raw = self._body.take()
        plane, flow = self._gateway.plane, self._flow if isinstance(self._flow, Flow) else None
        content_type = self._headers.get("content-type")
        self._s, plan = await self._s.plan(self._route, content_type, raw, self.request_id, plane, flow)
        self.plan, self._leases = plan, lease_ids(plan)
        if isinstance(plan, TokenOnly):
            self.plan = plan = await self._s.routable(plan, self.spawn)
            self._leases += [lease for lease in lease_ids(plan) if lease not in self._leases]
        assert not isinstance(plan, Passthrough)  # made from the request headers, never here
        self.record.mark("generate body")
        if isinstance(plan, Owned):
            self._owned = OwnedAnswer(self, self._s, plan, self.record)
            async for reply in self._owned.replies():
                yield reply
            self.mode = Mode.OWNED if self._owned.streaming else Mode.LOCAL
            return
        if isinstance(plan, Local) and plan.status >= 400:  # a refusal: an ImmediateResponse (EPP protocol)
            replies = [self._refuse(GatewayError(plan.status, "refused", body=plan.body, retry_after=plan.retry_after))]
        elif isinstance(plan, Local):  # after the body's end
            self.mode, replies = Mode.LOCAL, msg.local_response(plan.status, plan.body, self.record, plan.content_type)
        else:  # (a gateway that keeps the answer gets the client's body on its route: `as_sent`)
            as_sent = raw if isinstance(plan, Native) and not plane.rewrites else None
            limit = self._s.config.processor.destination_endpoints
            replies = msg.routed_replies(plan, self._unforwarded(), self.record, limit, as_sent)
            self.mode = Mode.PLANNED
        for reply in replies:
            if reply.HasField("request_body") and not end_of_stream:  # trailers will end the body
                reply.request_body.response.body_mutation.streamed_response.end_of_stream = False
            yield reply

    def _named(self, hosts: tuple[str, ...]) -> str:
        return ",".join(epp.named(hosts, self._s.config.processor.destination_endpoints))

    def _unforwarded(self) -> tuple[str, ...]:  # request headers removed: all but the forwarded few
        return (msg.DESTINATION_KEY, *msg.unforwarded_headers(self._headers))

    def _refuse(self, error: GatewayError) -> ext_proc_pb.ProcessingResponse:
        """An answer at any point before the client has response headers: no upstream is
        opened (or it is dropped), the rest is not read, held bytes are let go."""
        self.mode = Mode.LOCAL
        self._body.drop()
        return msg.immediate_response(error.status, error.body, self.record, error.retry_after)

    def on_bug(self) -> list[ext_proc_pb.ProcessingResponse]:  # a generic 500; the details are in the log
        error = GatewayError(500, f"internal gateway error (request {self.request_id})", code="internal_error")
        return self.interrupt(error)

    def interrupt(self, error: GatewayError) -> list[ext_proc_pb.ProcessingResponse]:
        """The answer ends now (a bug, the drain deadline, an eviction): as an error event and
        [DONE] once the client has headers, else as the error itself."""
        if self._owned is not None and self._owned.streaming:
            self._owned.fanout.interrupt(error)  # the writer sends it after what is queued
        if self.mode in (Mode.LOCAL, Mode.OWNED) or (self._handler is not None and self._handler.done):
            return []
        out = self._handler.interrupted(error) if self._handler is not None else refusal(self.plan, error)
        if isinstance(out, Chunk):  # the client has headers: the stream's error event
            return [msg.response_reply(out, self.record)]
        return [self._refuse(GatewayError(out.status, error.message, body=out.body, retry_after=error.retry_after))]

    async def _on_response_headers(self, message: ext_proc_pb.HttpHeaders) -> Replies:
        headers = self._response_head  # (read once, in on_message)
        status, content_type = int(headers.get(":status", "502")), headers.get("content-type", "")
        self.record.answered(status)  # unless the handler answers another
        cap, derender = self._s.config.processor.max_response_bytes, self._s.derender
        replay = partial(self._s.replay_native, self.plan, self._verdict.served_by)  # no token-only generate
        self._handler = handler_for(self.plan, status, content_type, derender, self._held, cap, replay)
        async for reply in self._response(lambda h: h.on_headers(status, content_type, message.end_of_stream)):
            yield reply

    async def _on_response_body(self, message: ext_proc_pb.HttpBody) -> Replies:
        self._s.triggers.first_chunk(routed(self.plan)[0] or "")  # a Trigger prefill's tokens go back
        async for reply in self._response(lambda h: h.on_body(message.body, message.end_of_stream)):
            yield reply

    async def _on_response_trailers(self, _: ext_proc_pb.HttpTrailers) -> Replies:
        async for reply in self._response(lambda h: h.on_trailers()):
            yield reply
        yield msg.response_trailers_reply(self.record)

    async def _response(self, step: Any) -> Replies:
        handler = self._handler
        if handler is None or handler.done or self.mode is Mode.LOCAL:
            return
        async for out in step(handler):
            if self.mode is Mode.LOCAL:  # answered meanwhile (an interruption): nothing follows
                return
            self.mode = Mode.LOCAL if isinstance(out, Refuse) else self.mode
            yield msg.response_reply(out, self.record)
