"""The Gateway API Inference Extension's Endpoint Picker protocol v1.0.0 (GIE
`docs/proposals/004-endpoint-picker-protocol`), as far as it differs from tito's own Envoy:
what a GIE gateway tells the processor (a subset hint, the served endpoint, its body modes)
and how the pick is named back (header and `envoy.lb` metadata, the same ordered list).

tito's own Envoy sends no subset and no served report (it adds `x-tito-upstream-host`
instead, `verdicts.py`) and streams both bodies: every function here then gives what the
processor did before it spoke the protocol."""

from __future__ import annotations

import logging
from typing import Any

from google.protobuf import json_format

from ext_proc.envoy_protocol.messages import (
    DESTINATION_KEY,
    HIDDEN_RESPONSE_HEADERS,
    LB_NAMESPACE,
    REQUEST_ID_HEADER,
    header_map,
    response_headers_reply,
)
from ext_proc.observability.request import RequestRecord
from ext_proc.protocol import DataPlane
from protos.stubs import core_pb, ext_proc_pb, processing_mode_pb2

log = logging.getLogger("tito.epp")

# §Endpoint Subset: [request, data plane -> EPP] filter metadata, a list of "ip:port" (some
# gateways flatten it into one comma-separated string with a HeaderToMetadata rule).
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# §Destination Endpoint: [EPP -> data plane] the header and the `envoy.lb` metadata key
# DESTINATION_KEY (messages.py), equal: "ip:port" or an ordered "ip:port,ip:port,..." the
# proxy walks on retries.
__all__ = ["DESTINATION_KEY", "LB_NAMESPACE", "Gateway"]
# §Destination Endpoint Served: [response, data plane -> EPP] the endpoint that answered.
SERVED_KEY = "x-gateway-destination-endpoint-served"
# Envoy's ext_proc body modes: the processor streams a body it rewrites only FULL_DUPLEX.
BodySendMode = processing_mode_pb2.ProcessingMode.BodySendMode
NONE, FULL_DUPLEX_STREAMED = BodySendMode.Value("NONE"), BodySendMode.Value("FULL_DUPLEX_STREAMED")


def _value(metadata: core_pb.Metadata, namespace: str, key: str) -> Any:
    if namespace not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[namespace].fields
    return json_format.MessageToDict(fields[key]) if key in fields else None


def _addresses(value: Any) -> list[str]:
    items = value if isinstance(value, list) else str(value).split(",")
    return [str(item).strip() for item in items if str(item).strip()]


def subset(message: ext_proc_pb.ProcessingRequest) -> frozenset[str] | None:
    """The engines the gateway lets this request use (an empty set: none), or None: any."""
    if not message.HasField("metadata_context"):
        return None
    value = _value(message.metadata_context, SUBSET_NAMESPACE, SUBSET_KEY)
    return None if value is None else frozenset(_addresses(value))


def served(message: ext_proc_pb.ProcessingRequest) -> str | None:
    """The endpoint the gateway says answered (after its retries down the list), if it says."""
    if not message.HasField("metadata_context"):
        return None
    value = _value(message.metadata_context, LB_NAMESPACE, SERVED_KEY)
    return _addresses(value)[0] if value else None


class Gateway:
    """What the proxy in front of one ext_proc stream sends and allows, as its messages say."""

    def __init__(self) -> None:
        self.plane = DataPlane()
        self.streams_request = True  # the request body streams here: the headers may wait for it
        self.response_body = True  # the response body reaches the processor (in some mode)
        self.served: str | None = None

    def read(
        self, message: ext_proc_pb.ProcessingRequest, record: RequestRecord
    ) -> ext_proc_pb.ProcessingResponse | None:
        """Learn what the message says of the gateway. A gateway that keeps the answer to
        itself gets the reply here: the engine's response goes to the client as it is."""
        kind = message.WhichOneof("request")
        if kind == "request_headers":  # the stream's first message: its modes and subset
            self.plane, self.streams_request = data_plane(message), streams_request(message)
            self.response_body = sends_response_body(message)
            report_modes(message)
        elif kind == "response_headers":
            self.served = served(message)
        if self.plane.rewrites or kind not in ("response_headers", "response_body"):
            return None
        if kind == "response_body":  # (STREAMED, BUFFERED): the piece goes on untouched
            record.chunk(message.response_body.end_of_stream)
            return ext_proc_pb.ProcessingResponse(response_body=ext_proc_pb.BodyResponse())
        record.answered(int(header_map(message.response_headers).get(":status", "502")))
        if message.response_headers.end_of_stream or not self.response_body:  # its end is not seen here
            record.chunk(True)
        return response_headers_reply({REQUEST_ID_HEADER: record.request_id}, HIDDEN_RESPONSE_HEADERS[1:])


def data_plane(message: ext_proc_pb.ProcessingRequest) -> DataPlane:
    """What the first message of a stream says the gateway allows. Without `protocol_config`
    (tito's Envoy sends it; other data planes may not), both bodies stream (tito's bootstrap)."""
    rewrites = True
    if message.HasField("protocol_config"):
        modes = message.protocol_config
        rewrites = modes.response_body_mode == FULL_DUPLEX_STREAMED
    return DataPlane(within=subset(message), rewrites=rewrites)


def streams_request(message: ext_proc_pb.ProcessingRequest) -> bool:
    """The request body streams through the processor (it may hold the headers for it)."""
    return not message.HasField("protocol_config") or message.protocol_config.request_body_mode == FULL_DUPLEX_STREAMED


def sends_response_body(message: ext_proc_pb.ProcessingRequest) -> bool:
    """The response body reaches the processor at all (in any mode): its end is seen here."""
    return not message.HasField("protocol_config") or message.protocol_config.response_body_mode != NONE


def named(hosts: tuple[str, ...], limit: int) -> tuple[str, ...]:
    """The engines a pick names, in order: all, or the first `limit` for gateways that parse
    one address (Envoy's ORIGINAL_DST on the header; `processor.destination_endpoints`)."""
    return hosts[:limit] if limit else hosts


_reported: set[tuple[int, int]] = set()


def report_modes(message: ext_proc_pb.ProcessingRequest) -> None:
    """One log line per body-mode pair a gateway uses: what the processor can do behind it."""
    if not message.HasField("protocol_config"):
        return
    modes = (message.protocol_config.request_body_mode, message.protocol_config.response_body_mode)
    if modes not in _reported:
        _reported.add(modes)
        names = [BodySendMode.Name(m) for m in modes]
        does = "token-only generate with derender" if modes[1] == FULL_DUPLEX_STREAMED else "native routing only"
        log.info("the gateway sends request body %s, response body %s: %s", *names, does)
