"""The processor's own HTTP/2 gRPC server against grpcio's client (the official gRPC
implementation, another HTTP/2 stack than Envoy's): messages and replies byte for byte, flow
control both ways past every window, cancellation, statuses, the message limit, unary calls,
and a stop with a grace period. Envoy in front of it: every integration and end-to-end test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2

from ext_proc.envoy_protocol.h2_server import NOT_FOUND, GrpcError, H2GrpcServer, Method, Outbox
from protos.stubs import ext_proc_pb
from tests.conftest import free_port

ECHO = "/test.Echo/Stream"
UNARY = "/test.Echo/Unary"
Request, Response = ext_proc_pb.ProcessingRequest, ext_proc_pb.ProcessingResponse
# (on the loop the fixtures run on) and never hanging
pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(60)]


def _request(body: bytes) -> ext_proc_pb.ProcessingRequest:
    request = Request()
    request.response_body.body = body
    return request


def _reply(body: bytes) -> ext_proc_pb.ProcessingResponse:
    reply = Response()
    reply.response_body.response.body_mutation.streamed_response.body = body
    return reply


class Echo:
    """Each message back as a reply; b"fail"/b"bug"/b"stop" end the call with a status, an
    exception or OK at once; b"twice" is answered with two replies. Records what it saw."""

    def __init__(self) -> None:
        self.cancelled = 0
        self.finished = 0
        self.started = asyncio.Event()

    async def stream(self, messages: AsyncIterator[ext_proc_pb.ProcessingRequest], outbox: Outbox) -> None:
        self.started.set()
        try:
            async for message in messages:
                body = message.response_body.body
                if body == b"fail":
                    raise GrpcError(NOT_FOUND, "nothing here: 100% sure")
                if body == b"bug":
                    raise RuntimeError("a handler bug")
                if body == b"stop":
                    return
                outbox.put(_reply(body))
                if body == b"twice":
                    outbox.put(_reply(body))
                await outbox.flush()  # (backpressure: as the processor's own sends wait)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.finished += 1

    async def unary(self, request: health_pb2.HealthCheckRequest) -> health_pb2.HealthCheckResponse:
        if request.service == "missing":
            raise GrpcError(NOT_FOUND, "unknown service 'missing'")
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture
async def served() -> AsyncIterator[tuple[Echo, H2GrpcServer, grpc.aio.Channel]]:
    echo = Echo()
    server = H2GrpcServer(
        {
            ECHO: Method(Request, echo.stream, stream=True),
            UNARY: Method(health_pb2.HealthCheckRequest, echo.unary, stream=False),
        },
        max_message_bytes=8 << 20,
        stream_window=1 << 20,
    )
    port = free_port()
    await server.start("127.0.0.1", port)
    options = [("grpc.max_receive_message_length", 16 << 20), ("grpc.max_send_message_length", 16 << 20)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        yield echo, server, channel
    await server.stop(0.5)


def _stream(channel: grpc.aio.Channel, path: str = ECHO) -> grpc.aio.StreamStreamCall:
    call = channel.stream_stream(
        path, request_serializer=Request.SerializeToString, response_deserializer=Response.FromString
    )
    return call()


async def _ask(call: grpc.aio.StreamStreamCall, body: bytes) -> bytes:
    await call.write(_request(body))
    reply = await call.read()
    assert reply is not grpc.aio.EOF
    return bytes(reply.response_body.response.body_mutation.streamed_response.body)


async def test_each_message_is_answered_in_order_on_many_streams_at_once(served) -> None:
    echo, _, channel = served

    async def one(n: int) -> list[bytes]:
        call = _stream(channel)
        got = [await _ask(call, f"{n}-{i}".encode()) for i in range(20)]
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF and await call.code() == grpc.StatusCode.OK
        return got

    results = await asyncio.gather(*(one(n) for n in range(40)))
    assert results == [[f"{n}-{i}".encode() for i in range(20)] for n in range(40)]
    assert echo.finished == 40 and echo.cancelled == 0


async def test_messages_larger_than_every_window_and_frame_go_through_both_ways(served) -> None:
    """A 5 MiB message in (the stream window is 1 MiB, a frame 16 KiB) and its 5 MiB reply
    out (grpcio's client window starts at 64 KiB): flow control both ways, nothing lost."""
    _, _, channel = served
    call = _stream(channel)
    big = bytes(range(256)) * (5 * 4096)
    for _ in range(3):
        assert await _ask(call, big) == big
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK


async def test_a_slow_reader_holds_the_peer_back_instead_of_buffering_without_bound(served) -> None:
    """Replies the client does not read: the handler's `flush` waits for the client's window,
    so its reading stops and so does the client's writing (the windows fill); the server
    holds at most a reply meanwhile, and every reply arrives once the client reads."""
    echo, server, channel = served
    call = _stream(channel)
    piece = b"x" * (256 << 10)

    async def upload() -> None:
        for _ in range(40):  # 10 MiB
            await call.write(_request(piece))
        await call.done_writing()

    uploading = asyncio.create_task(upload())
    await asyncio.sleep(0.5)
    assert not uploading.done()  # held back by the windows
    assert server.waiting_bytes() <= len(piece) + 64
    got = 0
    while (reply := await call.read()) is not grpc.aio.EOF:
        got += len(reply.response_body.response.body_mutation.streamed_response.body)
    await uploading
    assert got == 40 * len(piece) and await call.code() == grpc.StatusCode.OK and echo.finished == 1


async def test_a_cancelled_call_cancels_its_handler_and_the_others_go_on(served) -> None:
    echo, _, channel = served
    other = _stream(channel)
    assert await _ask(other, b"before") == b"before"
    call = _stream(channel)
    assert await _ask(call, b"hello") == b"hello"
    call.cancel()
    for _ in range(100):
        if echo.cancelled:
            break
        await asyncio.sleep(0.01)
    assert echo.cancelled == 1
    assert await _ask(other, b"after") == b"after"
    await other.done_writing()
    assert await other.code() == grpc.StatusCode.OK


@pytest.mark.parametrize(
    ("body", "code", "details"),
    [
        (b"fail", grpc.StatusCode.NOT_FOUND, "nothing here: 100% sure"),
        (b"bug", grpc.StatusCode.UNKNOWN, "processor error"),
        (b"stop", grpc.StatusCode.OK, None),
    ],
)
async def test_a_handler_that_ends_the_call_gives_its_status(served, body: bytes, code, details) -> None:
    """Also before the client has ended its side (the server resets the rest of the upload)."""
    _, _, channel = served
    call = _stream(channel)
    assert await _ask(call, b"first") == b"first"
    await call.write(_request(body))
    if code == grpc.StatusCode.OK:
        assert await call.read() is grpc.aio.EOF
    else:
        with pytest.raises(grpc.aio.AioRpcError):
            await call.read()
    assert await call.code() == code
    assert (await call.details() or None) == details


async def test_unknown_methods_and_oversized_messages_are_refused_with_their_status(served) -> None:
    """(Read before the write ends: grpcio's client reports a write that the refusal cut
    short as its own INTERNAL error.)"""
    _, _, channel = served
    unknown = _stream(channel, "/test.Echo/Missing")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await unknown.read()
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    call = _stream(channel)
    writing = asyncio.ensure_future(call.write(_request(b"x" * (9 << 20))))
    with pytest.raises(grpc.aio.AioRpcError) as too_big:
        await call.read()
    assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await asyncio.gather(writing, return_exceptions=True)
    assert await _ask(_stream(channel), b"still here") == b"still here"


async def test_a_unary_method_answers_once_or_with_its_error(served) -> None:
    _, _, channel = served
    check = channel.unary_unary(
        UNARY,
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    answer = await check(health_pb2.HealthCheckRequest(service=""))
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await check(health_pb2.HealthCheckRequest(service="missing"))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert missing.value.details() == "unknown service 'missing'"


async def test_stop_lets_open_calls_finish_within_the_grace_and_cancels_the_rest(served) -> None:
    echo, server, channel = served
    call = _stream(channel)
    assert await _ask(call, b"open") == b"open"
    stopping = asyncio.create_task(server.stop(0.3))
    await asyncio.sleep(0.1)
    assert await _ask(call, b"still served") == b"still served"  # within the grace
    await stopping
    assert echo.cancelled == 1
    with pytest.raises(grpc.aio.AioRpcError):
        await _ask(_stream(channel), b"after the stop")


# Envoy 1.40's first two ext_proc streams on one connection: the first block fills the dynamic
# table; every later stream's block is the second, byte for byte.
ENVOY_FIRST = bytes.fromhex(
    "8304a560b5773fa5d05b3b98855cbe5315761c8bf7657c1e525b2a1d1aec390a841ec635d872150841862f94c55d8727"
    "8640027465864d833505b11f5f8b1d75d0620d263d4c4d6564408cf2b16aee7f4b1aa496ca8747834d9697408bf2b4a7"
    "b3c0ec90b22d29ec870be25c0b89717f"
)
ENVOY_NEXT = bytes.fromhex(
    "8304a560b5773fa5d05b3b98855cbe5315761c8bf7657c1e525b2a1d1aec390a841ec635d8721508c286c1c0bfbe"
)


async def test_a_repeated_header_block_is_decoded_once_while_the_table_stays_as_it_was() -> None:
    import hpack

    from ext_proc.envoy_protocol.h2_server import HeaderBlocks

    blocks, plain = HeaderBlocks(), hpack.Decoder()
    decoded: list[bytes] = []
    decode = blocks.decoder.decode
    blocks.decoder.decode = lambda block, raw: decoded.append(block) or decode(block, raw=raw)  # type: ignore[method-assign]
    for block in (ENVOY_FIRST, ENVOY_NEXT, ENVOY_NEXT, ENVOY_NEXT):
        assert blocks.decode(block) == dict(plain.decode(block, raw=True))
    assert blocks.decode(ENVOY_NEXT)[b":path"] == b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"
    assert decoded == [ENVOY_FIRST, ENVOY_NEXT]


async def test_the_same_block_is_decoded_again_once_the_table_changed() -> None:
    """An indexed field names whatever entry the table holds at its index now."""
    import random

    import hpack

    from ext_proc.envoy_protocol.h2_server import HeaderBlocks

    newest = b"\xbe"  # the dynamic table's newest entry (index 62)
    encoder, blocks, plain = hpack.Encoder(), HeaderBlocks(), hpack.Decoder()
    rng = random.Random(7)
    seen = set()
    for step in range(400):
        if step % 50 == 49:
            encoder.header_table_size = rng.choice([0, 64, 256, 4096])  # a size update in the next block
        names = rng.sample([b"x-a", b"x-b", b"x-c", b":path", b"te"], rng.randint(1, 3))
        headers = [(n, str(rng.randint(0, 5)).encode()) for n in names]
        block = encoder.encode(headers) if rng.random() < 0.5 or not plain.header_table.dynamic_entries else newest
        want = dict(plain.decode(block, raw=True))
        assert blocks.decode(block) == want, step
        if block == newest:
            seen.add(tuple(want.items()))
    assert len(seen) > 3  # the same bytes meant different fields as the table changed
