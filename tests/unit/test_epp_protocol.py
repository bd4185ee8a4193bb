"""The Endpoint Picker protocol's side of the processor (`envoy_protocol/epp.py`), driven
message by message as a GIE gateway sends them: the subset hint (list and comma string), the
pick named alike in header and metadata, 503 outside the subset, the served report read back,
and what a gateway that keeps the bodies to itself gets."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import struct_pb2

from ext_proc.envoy_protocol.exchange import Exchange
from protos.stubs import core_pb, ext_proc_pb, processing_mode_pb2
from tests.unit.test_exchange import (
    CHAT,
    Engines,
    _body,
    _closed,
    _headers,
    _immediate,
    _response_headers,
    _routed,
    _run,
    _services,
)


@pytest.fixture
def engines() -> Engines:
    return Engines()


MODES = processing_mode_pb2.ProcessingMode.BodySendMode
FIRST, SECOND = "127.0.0.1:8201", "127.0.0.1:8202"


def _metadata(namespace: str, key: str, value: Any) -> core_pb.Metadata:
    fields = struct_pb2.Struct()
    fields.update({key: value})
    metadata = core_pb.Metadata()
    metadata.filter_metadata[namespace].CopyFrom(fields)
    return metadata


def _with_subset(message: Any, subset: Any) -> Any:
    message.metadata_context.CopyFrom(
        _metadata("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", subset)
    )
    return message


def _named(replies: list[Any]) -> tuple[str, str]:
    """The pick as the header and as the envoy.lb metadata name it."""
    headers, destination, _ = _routed(replies)
    return headers["x-gateway-destination-endpoint"], destination


async def test_the_pick_is_inside_the_subset_in_either_form(engines: Engines) -> None:
    services = _services(engines, scheduler={"policy": "round_robin"})
    exchanges = []
    for subset in ([SECOND], SECOND, [SECOND], f" {SECOND} ,"):
        exchanges.append(exchange := Exchange(services))
        header, metadata = _named(await _run(exchange, _with_subset(_headers(), subset), _body(CHAT)))
        assert header == metadata == SECOND  # (round robin would name the first engine every other time)
    await _closed(services, *exchanges)


async def test_without_a_subset_the_whole_ordered_list_is_named(engines: Engines) -> None:
    services = _services(engines, scheduler={"policy": "round_robin"})
    exchange = Exchange(services)
    header, metadata = _named(await _run(exchange, _headers(), _body(CHAT)))
    assert header == metadata and sorted(header.split(",")) == [FIRST, SECOND]
    await _closed(services, exchange)


async def test_destination_endpoints_cuts_the_list(engines: Engines) -> None:
    services = _services(engines, processor={"destination_endpoints": 1})
    exchange = Exchange(services)
    replies = await _run(exchange, _headers(), _body(CHAT))
    header, metadata = _named(replies)
    assert header == metadata and header in (FIRST, SECOND)
    assert {h.header.key: h.header.raw_value for h in replies[0].request_headers.response.header_mutation.set_headers}[
        "x-envoy-max-retries"
    ] == b"0"
    await _closed(services, exchange)


async def test_an_empty_or_foreign_subset_is_an_immediate_503(engines: Engines) -> None:
    services = _services(engines)
    for subset in ([], ["192.0.2.1:9"], ""):
        exchange = Exchange(services)
        status, body = _immediate(await _run(exchange, _with_subset(_headers(), subset), _body(CHAT)))
        assert status == 503 and "subset" in body["error"]["message"]
        await _closed(services, exchange)
    passthrough = Exchange(services)  # an unplanned request too
    status, _ = _immediate(await _run(passthrough, _with_subset(_headers("/v1/models", "GET", end=True), [])))
    assert status in (200, 503)  # /v1/models is the processor's own answer: no engine is picked
    await _closed(services, passthrough)


async def test_the_served_report_attributes_the_attempt(engines: Engines) -> None:
    """The list was walked: the first engine failed, the second served (no attempt count, no
    x-tito-upstream-host behind a GIE gateway: the report is all there is)."""
    services = _services(engines, processor={}, scheduler={"policy": "round_robin"})
    exchange = Exchange(services)
    header, _ = _named(await _run(exchange, _headers(), _body(CHAT)))
    first, second = header.split(",")
    served = _response_headers(200, "application/json")
    served.metadata_context.CopyFrom(_metadata("envoy.lb", "x-gateway-destination-endpoint-served", second))
    await _run(exchange, served)
    state = await _closed(services, exchange)
    assert state["instances"][first]["consecutive_failures"] == 1
    assert state["instances"][second]["consecutive_failures"] == 0


async def test_a_gateway_keeping_the_response_body_gets_the_client_request_as_sent(engines: Engines) -> None:
    services = _services(engines)
    exchange = Exchange(services)
    first = _headers()
    first.protocol_config.request_body_mode = MODES.Value("FULL_DUPLEX_STREAMED")
    first.protocol_config.response_body_mode = MODES.Value("NONE")
    replies = await _run(exchange, first, _body(CHAT))
    set_headers = {h.header.key for h in replies[0].request_headers.response.header_mutation.set_headers}
    assert ":path" not in set_headers and "x-gateway-destination-endpoint" in set_headers
    sent = b"".join(r.request_body.response.body_mutation.streamed_response.body for r in replies[1:])
    assert sent == _body(CHAT).request_body.body  # the engine's own route, the body unchanged
    [reply] = await _run(exchange, _response_headers(200, "application/json"))
    assert reply.HasField("response_headers") and not exchange.answered
    assert exchange.record.complete  # no body will come: the answer is over for the processor
    await _closed(services, exchange)


async def test_a_request_body_not_streamed_here_is_picked_from_the_headers(engines: Engines) -> None:
    services = _services(engines)
    exchange = Exchange(services)
    first = _with_subset(_headers(), [FIRST])
    first.protocol_config.request_body_mode = MODES.Value("BUFFERED")
    first.protocol_config.response_body_mode = MODES.Value("NONE")
    [reply] = await _run(exchange, first)  # answered at once: the gateway waits for it
    destination = reply.dynamic_metadata["envoy.lb"]["x-gateway-destination-endpoint"]
    assert destination == FIRST
    [body_reply] = await _run(exchange, _body(CHAT))
    assert body_reply.request_body == ext_proc_pb.BodyResponse()  # unchanged
    await _closed(services, exchange)
