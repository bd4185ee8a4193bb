"""Builders for the ext_proc ProcessingResponse messages tito sends back to Envoy.

Everything the client gets passes through the builders that take the request's `record`:
they stamp the gateway's request id on its headers (`x-request-id`) and tell the record the
status it got and when its response ended (metrics, traces, cancellations)."""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf import struct_pb2

from ext_proc.envoy_protocol.verdicts import ATTEMPT_COUNT_HEADER, UPSTREAM_HOST_HEADER
from ext_proc.errors import error_code
from ext_proc.observability.request import RequestRecord
from ext_proc.planning.bodies import routed_body
from ext_proc.planning.plan import Native, TokenOnly
from ext_proc.protocol import GENERATE_PATH
from ext_proc.response_handlers import Chunk, Head, Out
from protos.stubs import core_pb, ext_proc_pb, type_pb

# EPP protocol §Destination Endpoint: the pick, in this header and `envoy.lb` metadata alike.
LB_NAMESPACE = "envoy.lb"
DESTINATION_KEY = "x-gateway-destination-endpoint"
# Marks the processor's immediate responses: Envoy's local-reply formatter passes their
# (already OpenAI) bodies through and formats only its own replies (envoy/envoy.yaml.j2).
ANSWERED_NAMESPACE = "tito"
RETRIES_HEADER = "x-envoy-max-retries"  # set by the processor only (a client's is removed)
REQUEST_ID_HEADER = "x-request-id"
JSON = "application/json"
HIDDEN_RESPONSE_HEADERS = (
    "content-length",
    UPSTREAM_HOST_HEADER,
    ATTEMPT_COUNT_HEADER,
    "x-envoy-upstream-service-time",
)
# The only client request headers an engine receives (plus pseudo-headers and host, which
# Envoy owns): nothing a client sends may steer an engine (x-data-parallel-rank), Envoy's
# router (x-envoy-max-retries, x-envoy-retry-on) or reach it unasked (authorization, cookies).
FORWARDED_REQUEST_HEADERS = frozenset({"content-type", "accept", "traceparent", "tracestate"})
_ENVOY_OWNED = frozenset({"host", "transfer-encoding"})
# Envoy forwards body pieces of at most this size (envoy-ext-proc.md §2).
MAX_BODY_PIECE = 62 * 1024

Headers = dict[str, str]


def header_map(message: ext_proc_pb.HttpHeaders) -> Headers:
    """Envoy's headers as a dict (lower-case names; Envoy 1.40 sends raw_value)."""
    return {
        h.key: (h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value) for h in message.headers.headers
    }


def unforwarded_headers(headers: Headers) -> list[str]:
    """The client's request headers to remove before anything goes upstream."""
    return [
        name
        for name in headers
        if not name.startswith(":") and name not in FORWARDED_REQUEST_HEADERS and name not in _ENVOY_OWNED
    ]


def _header_mutation(set_headers: Headers | None, remove: Iterable[str]) -> ext_proc_pb.HeaderMutation:
    return ext_proc_pb.HeaderMutation(
        set_headers=[
            core_pb.HeaderValueOption(
                header=core_pb.HeaderValue(key=k, raw_value=v.encode()),
                append_action=core_pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            for k, v in (set_headers or {}).items()
        ],
        remove_headers=list(remove),
    )


def _common(set_headers: Headers | None = None, remove: Iterable[str] = ()) -> ext_proc_pb.CommonResponse:
    return ext_proc_pb.CommonResponse(header_mutation=_header_mutation(set_headers, remove))


def request_headers_reply(
    set_headers: Headers | None = None, remove: Iterable[str] = (), destination: str | None = None
) -> ext_proc_pb.ProcessingResponse:
    """The request's headers as they go upstream; `destination`: the engines picked, in the
    order to try, named in the header and the `envoy.lb` metadata alike (EPP protocol
    §Destination Endpoint: they must not differ). tito's Envoy routes on the metadata, which
    no client can set; GIE gateways on either."""
    if destination is not None:
        set_headers = {**(set_headers or {}), DESTINATION_KEY: destination}
    removed = [h for h in remove if h not in (set_headers or {})]
    response = ext_proc_pb.ProcessingResponse(
        request_headers=ext_proc_pb.HeadersResponse(response=_common(set_headers, removed))
    )
    if destination is not None:
        metadata = struct_pb2.Struct()
        metadata.update({LB_NAMESPACE: {DESTINATION_KEY: destination}})
        response.dynamic_metadata.CopyFrom(metadata)
    return response


def response_headers_reply(
    set_headers: Headers | None = None, remove: Iterable[str] = ()
) -> ext_proc_pb.ProcessingResponse:
    return ext_proc_pb.ProcessingResponse(
        response_headers=ext_proc_pb.HeadersResponse(response=_common(set_headers, remove))
    )


def _streamed(body: bytes, end_of_stream: bool) -> ext_proc_pb.CommonResponse:
    return ext_proc_pb.CommonResponse(
        body_mutation=ext_proc_pb.BodyMutation(
            streamed_response=ext_proc_pb.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
        )
    )


def request_body_replies(body: bytes, end_of_stream: bool = True) -> list[ext_proc_pb.ProcessingResponse]:
    """A new request body, in pieces Envoy accepts; `end_of_stream` on the last one."""
    pieces = [body[i : i + MAX_BODY_PIECE] for i in range(0, len(body), MAX_BODY_PIECE)] or [b""]
    return [
        ext_proc_pb.ProcessingResponse(
            request_body=ext_proc_pb.BodyResponse(response=_streamed(piece, end_of_stream and i == len(pieces) - 1))
        )
        for i, piece in enumerate(pieces)
    ]


def response_body_reply(body: bytes, end_of_stream: bool) -> ext_proc_pb.ProcessingResponse:
    return ext_proc_pb.ProcessingResponse(
        response_body=ext_proc_pb.BodyResponse(response=_streamed(body, end_of_stream))
    )


def request_body_unchanged() -> ext_proc_pb.ProcessingResponse:
    """A body piece goes on as it came (a gateway streaming it in a mode other than FULL_DUPLEX)."""
    return ext_proc_pb.ProcessingResponse(request_body=ext_proc_pb.BodyResponse())


def request_trailers_reply() -> ext_proc_pb.ProcessingResponse:
    return ext_proc_pb.ProcessingResponse(request_trailers=ext_proc_pb.TrailersResponse())


def response_trailers_reply(record: RequestRecord) -> ext_proc_pb.ProcessingResponse:
    record.chunk(True)  # trailers end the client's response
    return ext_proc_pb.ProcessingResponse(response_trailers=ext_proc_pb.TrailersResponse())


def local_response_headers(
    status: int, content_type: str, record: RequestRecord, code: str | int | None = None
) -> ext_proc_pb.ProcessingResponse:
    """Start of a response the processor owns (no upstream is contacted). No content-length."""
    record.answered(status, code)
    headers = core_pb.HeaderMap(
        headers=[
            core_pb.HeaderValue(key=":status", raw_value=str(status).encode()),
            core_pb.HeaderValue(key="content-type", raw_value=content_type.encode()),
            core_pb.HeaderValue(key=REQUEST_ID_HEADER, raw_value=record.request_id.encode()),
        ]
    )
    return ext_proc_pb.ProcessingResponse(
        streamed_immediate_response=ext_proc_pb.StreamedImmediateResponse(
            headers_response=ext_proc_pb.HttpHeaders(headers=headers, end_of_stream=False)
        )
    )


def local_response_body(body: bytes, end_of_stream: bool, record: RequestRecord) -> ext_proc_pb.ProcessingResponse:
    record.chunk(end_of_stream)
    return ext_proc_pb.ProcessingResponse(
        streamed_immediate_response=ext_proc_pb.StreamedImmediateResponse(
            body_response=ext_proc_pb.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
        )
    )


def local_response(
    status: int, body: bytes, record: RequestRecord, content_type: str = "application/json"
) -> list[ext_proc_pb.ProcessingResponse]:
    """A whole answer from the processor, once the request body has ended."""
    code = error_code(body) if status >= 400 else None
    return [local_response_headers(status, content_type, record, code), local_response_body(body, True, record)]


def immediate_response(
    status: int, body: bytes, record: RequestRecord, retry_after: int | None = None
) -> ext_proc_pb.ProcessingResponse:
    """An answer at any point before the response reaches the client, also while the request
    body is still arriving: Envoy sends it, opens no upstream and stops reading the request
    (a streamed immediate response there would still open the upstream: envoy-ext-proc.md §5).
    `retry_after`: seconds, for a refusal the client may retry (429)."""
    record.answered(status, error_code(body) if status >= 400 else None)
    record.chunk(True)
    headers = {"content-type": JSON, REQUEST_ID_HEADER: record.request_id}
    if retry_after is not None:
        headers["retry-after"] = str(retry_after)
    response = ext_proc_pb.ProcessingResponse(
        immediate_response=ext_proc_pb.ImmediateResponse(
            status=type_pb.HttpStatus(code=status),
            headers=_header_mutation(headers, HIDDEN_RESPONSE_HEADERS),
            body=body,
        )
    )
    metadata = struct_pb2.Struct()
    metadata.update({ANSWERED_NAMESPACE: {"answered": True}})
    response.dynamic_metadata.CopyFrom(metadata)
    return response


def response_reply(out: Out, record: RequestRecord) -> ext_proc_pb.ProcessingResponse:
    """A response handler's output as the message Envoy expects at this point."""
    if isinstance(out, Head):
        set_headers = {":status": str(out.status)} if out.status is not None else {}
        if out.status is not None:
            record.answered(out.status)
        if out.content_type is not None:
            set_headers["content-type"] = out.content_type
        set_headers[REQUEST_ID_HEADER] = record.request_id
        hidden = HIDDEN_RESPONSE_HEADERS[1:] if out.same_body else HIDDEN_RESPONSE_HEADERS
        return response_headers_reply(set_headers=set_headers, remove=hidden)
    if isinstance(out, Chunk):
        record.chunk(out.end)
        return response_body_reply(out.data, out.end)
    return immediate_response(out.status, out.body, record)


def routed_replies(
    plan: Native | TokenOnly,
    remove: tuple[str, ...],
    record: RequestRecord,
    limit: int = 0,
    as_sent: bytes | None = None,
) -> list[ext_proc_pb.ProcessingResponse]:
    """The request as planned, to the engine Envoy will route it to: a native body as it is,
    or the routed leg's generate body on `/inference/v1/generate`; `as_sent`: the client's
    own body on its own route (a gateway that keeps the answer from the processor).

    Envoy retries (before the first byte) only on the listed hosts: one cluster holds every
    engine of every role, and a retry past the list would land on any of them. `limit`: how
    many of them the pick names (0: all; `processor.destination_endpoints`)."""
    hosts = plan.hosts if isinstance(plan, Native) else plan.routed.hosts
    hosts = hosts[:limit] if limit else hosts
    lease = plan.lease_id if isinstance(plan, Native) else plan.routed.lease_id
    # The engine leg's trace context (tracing on), else the client's traceparent goes as it came.
    set_headers = {RETRIES_HEADER: str(len(hosts) - 1), **record.leg(lease, hosts)}
    if as_sent is not None:
        body = as_sent
    elif isinstance(plan, TokenOnly):
        set_headers |= {":path": GENERATE_PATH, "content-type": JSON, "x-request-id": plan.routed.lease_id}
        remove, body = ("content-length", *remove), routed_body(plan)
    elif plan.request.conversion is not None:  # a pipeline request made of the client's: to its own endpoint
        set_headers[":path"] = plan.request.endpoint
        remove, body = ("content-length", *remove), plan.body
    else:
        body = plan.body
    headers = request_headers_reply(set_headers=set_headers, remove=remove, destination=",".join(hosts))
    return [headers, *request_body_replies(body)]
