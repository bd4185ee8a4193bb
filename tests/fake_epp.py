"""A fake Endpoint Picker and fake engines for `tito epp-check`'s tests.

The fake EPP speaks the GIE EPP protocol v1 over ext_proc as a FULL_DUPLEX picker does (it
answers a request's headers once its body has ended), picks among its engines in turn and
names them all as an ordered fallback list; `Faults` break one rule each, so that every check
is shown able to fail. The engines answer any POST with a fixed chat completion (SSE when the
request asks to stream)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import orjson
from google.protobuf import json_format, struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ext_proc.tools import epp_check
from protos.stubs import core_pb, ext_proc_grpc, ext_proc_pb, type_pb
from tests.servers import ThreadedServer

COMPLETION = {
    "id": "chatcmpl-fake",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
}
CHUNK = {
    "id": "chatcmpl-fake",
    "object": "chat.completion.chunk",
    "choices": [{"index": 0, "delta": {"content": "hi"}}],
}
EVENTS = [b"data: " + orjson.dumps(CHUNK) + b"\n\n", b"data: [DONE]\n\n"]
PRIVATE_ROUTE = "/v1/private/generate"


@dataclass(frozen=True)
class Faults:
    """One broken rule each (all False: a conforming EPP)."""

    ignores_subset: bool = False  # picks from the whole pool whatever the subset
    ignores_comma_subset: bool = False  # reads the subset as a list only (a comma string: unset)
    header_differs: bool = False  # the header lists the endpoints in another order than the metadata
    no_503: bool = False  # picks from the whole pool when the subset leaves none
    no_health: bool = False  # serves no gRPC health
    lists_one: bool = False  # names one endpoint per pick: no fallback
    rejects_fallback: bool = False  # 502 when the served endpoint is not its first pick
    drops_done: bool = False  # hands the client a stream without its `data: [DONE]`
    rewrites_path: bool = False  # routes to the engine's private route even when it sees no response body
    answers_streams: bool = False  # answers a streaming request itself (StreamedImmediateResponse)
    sheds_with: int = 429  # the status of a request shed


@dataclass
class _Stream:
    """One ext_proc stream's state, as the fake EPP knows it."""

    subset: list[str] | None = None
    body: bytes = b""
    destination: list[str] = field(default_factory=list)


class FakeEpp(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, pool: list[str], faults: Faults, max_open: int) -> None:
        self.pool = pool
        self.faults = faults
        self.max_open = max_open  # more streams open than this: the next request is shed
        self.open = 0
        self.served: list[str] = []  # the data plane's served reports
        self._turn = 0

    async def Process(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:  # noqa: N802
        self.open += 1
        try:
            state = _Stream()
            async for message in requests:
                for reply in self._on(message, state):
                    yield reply
        finally:
            self.open -= 1

    def _on(self, message: Any, state: _Stream) -> list[Any]:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            state.subset = self._subset(message)
        elif kind == "request_body":
            state.body += message.request_body.body
            if message.request_body.end_of_stream:
                return self._decide(state)
        elif kind == "response_headers":
            return self._on_response_headers(message, state)
        elif kind == "response_body":
            return [_response_piece(message.response_body, self.faults.drops_done)]
        return []

    def _subset(self, message: Any) -> list[str] | None:
        hint = message.metadata_context.filter_metadata.get(epp_check.SUBSET_NAMESPACE)
        if hint is None or epp_check.SUBSET_KEY not in hint.fields:
            return None
        value = json_format.MessageToDict(hint.fields[epp_check.SUBSET_KEY])
        if isinstance(value, str):
            return None if self.faults.ignores_comma_subset else epp_check.split(value)
        return [str(v) for v in value]

    def _eligible(self, subset: list[str] | None) -> list[str]:
        if subset is None or self.faults.ignores_subset:
            return list(self.pool)
        allowed = [e for e in self.pool if e in subset]
        return list(self.pool) if not allowed and self.faults.no_503 else allowed

    def _decide(self, state: _Stream) -> list[Any]:
        if self.open > self.max_open:
            return [_immediate(self.faults.sheds_with)]
        eligible = self._eligible(state.subset)
        if not eligible:
            return [_immediate(503)]
        if self.faults.answers_streams and orjson.loads(state.body).get("stream"):
            return _streamed_answer()
        self._turn += 1
        turn = self._turn % len(eligible)
        state.destination = (eligible[turn:] + eligible[:turn])[: 1 if self.faults.lists_one else None]
        return self._route(state)

    def _route(self, state: _Stream) -> list[Any]:
        value = ",".join(state.destination)
        header = ",".join(reversed(state.destination)) if self.faults.header_differs else value
        headers = {epp_check.DESTINATION_KEY: header}
        if self.faults.rewrites_path:
            headers[":path"] = PRIVATE_ROUTE
        metadata = struct_pb2.Struct()
        metadata.update({epp_check.LB_NAMESPACE: {epp_check.DESTINATION_KEY: value}})
        body = ext_proc_pb.BodyMutation(
            streamed_response=ext_proc_pb.StreamedBodyResponse(body=state.body, end_of_stream=True)
        )
        return [
            ext_proc_pb.ProcessingResponse(
                request_headers=ext_proc_pb.HeadersResponse(response=_common(headers)), dynamic_metadata=metadata
            ),
            ext_proc_pb.ProcessingResponse(
                request_body=ext_proc_pb.BodyResponse(response=ext_proc_pb.CommonResponse(body_mutation=body))
            ),
        ]

    def _on_response_headers(self, message: Any, state: _Stream) -> list[Any]:
        lb = message.metadata_context.filter_metadata[epp_check.LB_NAMESPACE]
        served = lb.fields[epp_check.SERVED_KEY].string_value
        self.served.append(served)
        if self.faults.rejects_fallback and served != state.destination[0]:
            return [_immediate(502)]
        return [ext_proc_pb.ProcessingResponse(response_headers=ext_proc_pb.HeadersResponse(response=_common({})))]


def _common(headers: dict[str, str]) -> Any:
    options = [
        core_pb.HeaderValueOption(header=core_pb.HeaderValue(key=k, raw_value=v.encode())) for k, v in headers.items()
    ]
    return ext_proc_pb.CommonResponse(header_mutation=ext_proc_pb.HeaderMutation(set_headers=options))


def _immediate(status: int) -> Any:
    body = orjson.dumps({"error": {"code": status}})
    return ext_proc_pb.ProcessingResponse(
        immediate_response=ext_proc_pb.ImmediateResponse(status=type_pb.HttpStatus(code=status), body=body)
    )


def _response_piece(piece: Any, drops_done: bool) -> Any:
    body = piece.body.replace(b"data: [DONE]\n\n", b"") if drops_done else piece.body
    streamed = ext_proc_pb.StreamedBodyResponse(body=body, end_of_stream=piece.end_of_stream)
    mutation = ext_proc_pb.BodyMutation(streamed_response=streamed)
    return ext_proc_pb.ProcessingResponse(
        response_body=ext_proc_pb.BodyResponse(response=ext_proc_pb.CommonResponse(body_mutation=mutation))
    )


def _streamed_answer() -> list[Any]:
    headers = {":status": "200", "content-type": "text/event-stream"}
    header_map = core_pb.HeaderMap(
        headers=[core_pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    )
    parts = [ext_proc_pb.StreamedImmediateResponse(headers_response=ext_proc_pb.HttpHeaders(headers=header_map))]
    parts += [
        ext_proc_pb.StreamedImmediateResponse(
            body_response=ext_proc_pb.StreamedBodyResponse(body=event, end_of_stream=n == len(EVENTS) - 1)
        )
        for n, event in enumerate(EVENTS)
    ]
    return [ext_proc_pb.ProcessingResponse(streamed_immediate_response=part) for part in parts]


@contextlib.asynccontextmanager
async def serving(
    pool: list[str], faults: Faults = Faults(), max_open: int = 1000
) -> AsyncIterator[tuple[str, FakeEpp]]:
    """The fake EPP listening on a free local port: its address and itself."""
    server = grpc.aio.server()
    epp = FakeEpp(pool, faults, max_open)
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(epp, server)
    if not faults.no_health:
        health = health_aio.HealthServicer()
        for service in epp_check.HEALTH_SERVICES:
            await health.set(service, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", epp
    finally:
        await server.stop(None)


async def _complete(request: Request) -> Response:
    if (await request.json()).get("stream"):
        return StreamingResponse(iter(EVENTS), media_type="text/event-stream")
    return JSONResponse(COMPLETION)


@contextlib.contextmanager
def engines(count: int) -> Iterator[list[str]]:
    """`count` fake engines on free local ports: their <ip:port>."""
    app = Starlette(routes=[Route("/{path:path}", _complete, methods=["POST"])])
    servers = [ThreadedServer(app).start() for _ in range(count)]
    try:
        yield [f"{server.host}:{server.port}" for server in servers]
    finally:
        for server in servers:
            server.stop()
