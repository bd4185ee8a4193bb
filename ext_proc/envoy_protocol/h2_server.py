"""The processor's gRPC server on its own HTTP/2 framing (`processor.grpc_server: h2`).

Why not grpc.aio: it costs the processor about 0.5 ms of CPU to open and end a stream and
about 200 µs per message, and a request is one stream of about a dozen messages: half of the
processor's CPU per request (`docs/performance.md`, `tests/bench/grpc_bench.py`). Most of that
is grpc's machinery (its poller thread handing each completion to the loop), not the kernel's
work (a TCP echo on uvloop: 40 µs). This server parses HTTP/2 frames in the protocol's
`data_received`, on the event loop, and writes each reply with one `transport.write`.

What it speaks is what a gRPC client (Envoy, grpcio) needs from a server: cleartext HTTP/2
with prior knowledge (RFC 9113), HPACK request headers (decoded with the `hpack` library;
replies use literal fields only, so no dynamic table of ours), gRPC's length-prefixed
messages, statuses in trailers, flow control both ways (a fixed receive window per stream,
credited as the handler reads: a slow stream cannot make the peer buffer here without
bound), PING, SETTINGS, RST_STREAM (the handler is cancelled, as grpc.aio cancels), GOAWAY
on stop. Not spoken: TLS, compressed messages (refused, as the processor never asks for
them), server push."""

from __future__ import annotations

import asyncio
import collections
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast
from urllib.parse import quote

import hpack
from hpack.table import HeaderTable

log = logging.getLogger("tito.h2")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, COMPRESSION_ERROR = 0x0, 0x1, 0x3, 0x6, 0x9
CANCEL = 0x8
SETTINGS_HEADER_TABLE_SIZE, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 0x1, 0x4, 0x5
DEFAULT_WINDOW = 65535
MAX_WINDOW = (1 << 31) - 1
DEFAULT_FRAME = 16384
# The connection's receive window: credited as frames arrive (each stream's own window bounds
# what waits here), so one stalled stream never stalls the others on the connection.
CONNECTION_WINDOW = 64 << 20
# gRPC status codes (grpc/doc/statuscodes.md)
OK, CANCELLED, UNKNOWN, NOT_FOUND, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL = 0, 1, 2, 5, 8, 12, 13

_FRAME_HEADER = struct.Struct(">BHBBI")  # length as 1 + 2 bytes, type, flags, stream id
_WINDOW = struct.Struct(">I")
# `:status: 200` (static table index 8) and `content-type: application/grpc` (literal without
# indexing, name from static index 31): the reply headers of every call.
_REPLY_HEADERS = b"\x88\x0f\x10\x10application/grpc"
_PRINTABLE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")
BLOCKS_KEPT = 64  # distinct header blocks remembered per connection (Envoy sends one or two)


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _FRAME_HEADER.pack(n >> 16, n & 0xFFFF, kind, flags, stream_id) + payload


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """RFC 7541 §5.1 integer representation."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """A literal header field without indexing, new name, no Huffman coding (RFC 7541 §6.2.2)."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


def _trailers(status: int, message: str) -> bytes:
    block = _literal(b"grpc-status", str(status).encode())
    if message:  # percent-encoded, as gRPC's HTTP/2 mapping asks (printable ASCII but % as is)
        block += _literal(b"grpc-message", quote(message[:1024], safe=_PRINTABLE).encode())
    return block


_MAXSIZE = cast(property, vars(HeaderTable)["maxsize"])


class _Table(HeaderTable):
    """hpack's dynamic table, counting its changes (an entry added, a new size)."""

    def __init__(self) -> None:
        super().__init__()
        self.version = 0

    def add(self, name: bytes, value: bytes) -> None:
        self.version += 1
        super().add(name, value)

    def _resize(self, size: int) -> None:
        self.version += 1
        assert _MAXSIZE.fset is not None
        _MAXSIZE.fset(self, size)

    maxsize = property(_MAXSIZE.fget, _resize)


class HeaderBlocks:
    """A connection's HPACK header blocks, decoded (RFC 7541, the `hpack` library).

    Envoy opens every ext_proc stream of a connection with the same block once its dynamic
    table holds the repeated fields: indexed fields and `:path` as a literal that is not
    indexed. A block that left the table as it was means the same fields again for as long as
    the table stays as it was, so such a block is decoded once (decoding it again took 28 µs
    per stream, warm)."""

    def __init__(self) -> None:
        self.decoder = hpack.Decoder()
        self.table = self.decoder.header_table = _Table()
        self._known: dict[bytes, dict[bytes, bytes]] = {}  # blocks that change nothing
        self._version = 0  # the table's version they were decoded at

    def decode(self, block: bytes) -> dict[bytes, bytes]:
        if self.table.version != self._version:
            self._known.clear()
            self._version = self.table.version
        headers = self._known.get(block)
        if headers is None:
            headers = dict(self.decoder.decode(block, raw=True))
            if self.table.version == self._version and len(self._known) < BLOCKS_KEPT:
                self._known[block] = headers
        return headers


class GrpcError(Exception):
    """A handler ends its call with this status (as `context.abort` does in grpc.aio)."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Outbox(Protocol):
    """Where a call's replies go, in the order put. `put` never waits: the bytes go out at
    once as far as the windows allow, the rest waits in order. `flush` returns once the
    transport has taken every reply put so far (backpressure for a writer that needs it)."""

    def put(self, message: Any) -> None: ...

    async def flush(self) -> None: ...


Incoming = AsyncIterator[Any]  # a call's messages, as they arrive
StreamHandler = Callable[[Incoming, Outbox], Awaitable[None]]
UnaryHandler = Callable[[Any], Awaitable[Any]]


@dataclass(frozen=True)
class Method:
    """One gRPC method: how its requests parse, and its handler. `stream`: a bidirectional
    stream (the handler reads the messages and puts replies in the call's outbox); else unary
    (one request, the handler's return value is the one reply)."""

    request_type: Any
    handler: Callable[..., Awaitable[Any]]  # a StreamHandler or a UnaryHandler, as `stream` says
    stream: bool


class _Stream:
    """One call: its messages in, its replies out, its two flow-control windows."""

    __slots__ = (
        "id", "method", "task", "inbox", "waiter", "partial", "received", "uncredited", "queued_bytes",
        "send_window", "pending", "drained", "headers_sent", "remote_ended", "local_ended", "reset",
    )  # fmt: skip

    def __init__(self, stream_id: int, method: Method, send_window: int) -> None:
        self.id = stream_id
        self.method = method
        self.task: asyncio.Task[None] | None = None
        self.inbox: collections.deque[tuple[Any, int] | None] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.partial = b""  # the bytes of a message still arriving
        self.received = 0  # bytes of the message being delivered (framing included)
        self.uncredited = 0  # received bytes not yet given back to the peer's window
        self.queued_bytes = 0  # bytes of messages in the inbox, not yet read by the handler
        self.send_window = send_window
        self.pending = bytearray()  # reply bytes waiting for the peer's window
        self.drained: asyncio.Future[None] | None = None
        self.headers_sent = False
        self.remote_ended = False
        self.local_ended = False
        self.reset = False

    def deliver(self, item: tuple[Any, int] | None) -> None:
        self.inbox.append(item)
        if item is not None:
            self.queued_bytes += item[1]
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class _Connection(asyncio.Protocol):
    def __init__(self, server: H2GrpcServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.preface = False
        self.header_blocks = HeaderBlocks()
        self.streams: dict[int, _Stream] = {}
        self.last_stream = 0
        self.header_block: tuple[int, int, bytearray] | None = None  # (stream id, flags, block)
        self.peer_window = DEFAULT_WINDOW  # the connection's send window
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = DEFAULT_FRAME
        self.blocked: collections.OrderedDict[int, _Stream] = collections.OrderedDict()
        self.received = 0  # connection bytes not yet credited
        self.paused: asyncio.Future[None] | None = None
        self.going_away = False
        self.unsent: list[bytes] | None = None  # frames of this turn of the loop (`_write`)

    # -- the transport's side ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        settings = struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, self.server.stream_window)
        credit = _WINDOW.pack(CONNECTION_WINDOW - DEFAULT_WINDOW)
        self._write(_frame(SETTINGS, 0, 0, settings) + _frame(WINDOW_UPDATE, 0, 0, credit))

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        for stream in list(self.streams.values()):
            self._cancel(stream)
        if self.paused is not None and not self.paused.done():
            self.paused.set_result(None)

    def pause_writing(self) -> None:
        if self.paused is None or self.paused.done():
            self.paused = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.paused is not None and not self.paused.done():
            self.paused.set_result(None)

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer + data if self.buffer else data
        position = 0
        if not self.preface:
            if len(buffer) < len(PREFACE):
                self.buffer = buffer
                return
            if buffer[: len(PREFACE)] != PREFACE:
                log.warning("a connection that does not speak HTTP/2 (no client preface): closed")
                self._close()
                return
            self.preface = True
            position = len(PREFACE)
        end = len(buffer)
        try:
            while end - position >= 9:
                length = (buffer[position] << 16) | (buffer[position + 1] << 8) | buffer[position + 2]
                if length > DEFAULT_FRAME:  # we never raise SETTINGS_MAX_FRAME_SIZE
                    raise _ConnectionError(FRAME_SIZE_ERROR, f"a frame of {length} bytes")
                if end - position < 9 + length:
                    break
                kind, flags = buffer[position + 3], buffer[position + 4]
                stream_id = int.from_bytes(buffer[position + 5 : position + 9], "big") & 0x7FFFFFFF
                payload = buffer[position + 9 : position + 9 + length]
                position += 9 + length
                self._on_frame(kind, flags, stream_id, payload)
        except _ConnectionError as error:
            self._go_away(error.code, str(error))
            return
        except (struct.error, IndexError) as error:  # a frame shorter than its type's fields
            self._go_away(FRAME_SIZE_ERROR, f"a malformed frame: {error}")
            return
        self.buffer = buffer[position:]

    # -- frames in ----------------------------------------------------------------------

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self.header_block is not None and kind != CONTINUATION:
            raise _ConnectionError(PROTOCOL_ERROR, "a header block interrupted")
        if kind == DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == HEADERS:
            if flags & PADDED:
                payload = payload[1 : len(payload) - payload[0]]
            if flags & PRIORITY_FLAG:
                payload = payload[5:]
            self.header_block = (stream_id, flags, bytearray(payload))
            if flags & END_HEADERS:
                self._on_headers()
        elif kind == CONTINUATION:
            if self.header_block is None or self.header_block[0] != stream_id:
                raise _ConnectionError(PROTOCOL_ERROR, "CONTINUATION out of place")
            self.header_block[2].extend(payload)
            if flags & END_HEADERS:
                self._on_headers()
        elif kind == SETTINGS:
            if not flags & ACK:
                self._on_settings(payload)
        elif kind == PING:
            if not flags & ACK:
                self._write(_frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            self._on_window_update(stream_id, _WINDOW.unpack(payload)[0] & 0x7FFFFFFF)
        elif kind == RST_STREAM:
            stream = self.streams.get(stream_id)
            if stream is not None:
                stream.reset = True
                self._cancel(stream)
        elif kind == GOAWAY:
            self.going_away = True  # the peer opens no more streams; open ones go on
        elif kind == PUSH_PROMISE:
            raise _ConnectionError(PROTOCOL_ERROR, "a client sent PUSH_PROMISE")
        # PRIORITY and unknown frame types: ignored (RFC 9113 §5.5)

    def _on_settings(self, payload: bytes) -> None:
        for offset in range(0, len(payload) - len(payload) % 6, 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, "initial window too large")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for stream in self.streams.values():
                    stream.send_window += delta
            elif key == SETTINGS_MAX_FRAME_SIZE:
                self.peer_max_frame = value
            elif key == SETTINGS_HEADER_TABLE_SIZE:
                pass  # our replies never use the dynamic table
        self._write(_frame(SETTINGS, ACK, 0))
        self._flush_blocked()

    def _on_window_update(self, stream_id: int, increment: int) -> None:
        if stream_id == 0:
            self.peer_window += increment
        elif (stream := self.streams.get(stream_id)) is not None:
            stream.send_window += increment
        self._flush_blocked()

    def _on_headers(self) -> None:
        assert self.header_block is not None
        stream_id, flags, block = self.header_block
        self.header_block = None
        try:
            headers = self.header_blocks.decode(bytes(block))
        except Exception as error:  # hpack's errors: the connection's compression state is lost
            raise _ConnectionError(COMPRESSION_ERROR, f"header block: {error}") from error
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers from the client: its side ends
            if flags & END_STREAM:
                self._remote_end(stream)
            return
        if stream_id % 2 == 0:
            raise _ConnectionError(PROTOCOL_ERROR, f"a client cannot open stream {stream_id}")
        if stream_id <= self.last_stream:
            return  # a stream that has ended here (its block was still decoded: HPACK's state)
        self.last_stream = stream_id
        path = headers.get(b":path", b"").decode("latin-1")
        method = self.server.methods.get(path)
        if self.going_away or self.server.stopping:
            self._write(_frame(RST_STREAM, 0, stream_id, _WINDOW.pack(0x7)))  # REFUSED_STREAM
            return
        if method is None or headers.get(b":method") != b"POST":
            self._trailers_only(stream_id, UNIMPLEMENTED, f"unknown method {path}")
            return
        if headers.get(b"grpc-encoding", b"identity") != b"identity":
            self._trailers_only(stream_id, UNIMPLEMENTED, "compressed messages are not accepted")
            return
        stream = _Stream(stream_id, method, self.peer_initial_window)
        self.streams[stream_id] = stream
        stream.task = self.loop.create_task(self._run(stream))
        if flags & END_STREAM:
            self._remote_end(stream)

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        self.received += len(payload)
        if self.received >= CONNECTION_WINDOW // 2:
            self._write(_frame(WINDOW_UPDATE, 0, 0, _WINDOW.pack(self.received)))
            self.received = 0
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_ended:
            return  # a stream reset or answered: its late data only counts for the connection
        stream.uncredited += len(payload)
        if flags & PADDED:
            payload = payload[1 : len(payload) - payload[0]]
        data = stream.partial + payload if stream.partial else payload
        position, end = 0, len(data)
        limit = self.server.max_message_bytes
        while end - position >= 5:
            size = int.from_bytes(data[position + 1 : position + 5], "big")
            if data[position]:
                self._fail(stream, INTERNAL, "a compressed message without grpc-encoding")
                return
            if size > limit:
                self._fail(stream, RESOURCE_EXHAUSTED, f"a message of {size} bytes (the limit is {limit})")
                return
            if end - position < 5 + size:
                break
            try:
                message = stream.method.request_type.FromString(data[position + 5 : position + 5 + size])
            except Exception:
                self._fail(stream, INTERNAL, "a message that does not parse")
                return
            stream.deliver((message, 5 + size))
            position += 5 + size
        stream.partial = data[position:]
        self._credit(stream)
        if flags & END_STREAM:
            self._remote_end(stream)

    def _remote_end(self, stream: _Stream) -> None:
        if not stream.remote_ended:
            stream.remote_ended = True
            stream.deliver(None)

    # -- the stream's own flow control ------------------------------------------------------

    def _credit(self, stream: _Stream) -> None:
        """Give the peer back what it sent on the stream, unless the handler is behind on
        reading (then the window fills and the peer waits: backpressure)."""
        window = self.server.stream_window
        if stream.uncredited >= window // 4 and stream.queued_bytes < window // 2 and not stream.remote_ended:
            self._write(_frame(WINDOW_UPDATE, 0, stream.id, _WINDOW.pack(stream.uncredited)))
            stream.uncredited = 0

    async def _messages(self, stream: _Stream) -> AsyncIterator[Any]:
        while True:
            while not stream.inbox:
                stream.waiter = self.loop.create_future()
                await stream.waiter
            item = stream.inbox.popleft()
            if item is None:
                return
            message, size = item
            stream.queued_bytes -= size
            self._credit(stream)
            yield message

    # -- replies out ------------------------------------------------------------------------

    def _put(self, stream: _Stream, message: Any) -> None:
        """A reply, written now as far as the windows allow: no task between the handler and
        the socket (a hand-off per reply cost the loop more than the write)."""
        if stream.local_ended or stream.reset:
            return  # the call ended (the handler is being cancelled): nobody to tell
        data = message.SerializeToString()
        out = b"" if stream.headers_sent else _frame(HEADERS, END_HEADERS, stream.id, _REPLY_HEADERS)
        stream.headers_sent = True
        framed = len(data).to_bytes(5, "big") + data  # (the first byte: not compressed)
        self._queue_data(stream, framed, out)

    async def _flush(self, stream: _Stream) -> None:
        if stream.local_ended or stream.reset:
            raise asyncio.CancelledError  # the call ended: as grpc.aio's write would fail
        if stream.pending:  # wait for the peer's window, as grpc.aio's write waits
            if stream.drained is None or stream.drained.done():
                stream.drained = self.loop.create_future()
            await stream.drained
        if self.paused is not None and not self.paused.done():
            await self.paused

    def _queue_data(self, stream: _Stream, data: bytes, before: bytes = b"") -> None:
        if stream.pending:
            stream.pending += data
            data = b""
        else:
            stream.pending = bytearray(data)
        out = bytearray(before)
        self._drain(stream, out)
        if out:
            self._write(bytes(out))

    def _drain(self, stream: _Stream, out: bytearray) -> None:
        """Frame as much of `stream.pending` as both windows allow into `out`."""
        while stream.pending:
            size = min(len(stream.pending), stream.send_window, self.peer_window, self.peer_max_frame)
            if size <= 0:
                self.blocked[stream.id] = stream
                return
            out += _frame(DATA, 0, stream.id, bytes(stream.pending[:size]))
            del stream.pending[:size]
            stream.send_window -= size
            self.peer_window -= size
        self.blocked.pop(stream.id, None)
        if stream.drained is not None and not stream.drained.done():
            stream.drained.set_result(None)

    def _flush_blocked(self) -> None:
        out = bytearray()
        for stream in list(self.blocked.values()):
            self._drain(stream, out)
            if self.peer_window <= 0:  # (a stream whose own window is closed waits alone)
                break
        if out:
            self._write(bytes(out))

    def _end(self, stream: _Stream, status: int, message: str = "") -> None:
        """The call's trailers (after any reply still waiting for a window)."""
        if stream.local_ended or stream.reset or self.transport is None:
            return
        stream.local_ended = True
        # (data still waiting for a window: only after the handler failed or was cancelled,
        # as `_run` flushes first otherwise; trailers cannot follow it, so it goes)
        stream.pending.clear()
        self.blocked.pop(stream.id, None)
        block = _trailers(status, message) if stream.headers_sent else _REPLY_HEADERS + _trailers(status, message)
        out = _frame(HEADERS, END_STREAM | END_HEADERS, stream.id, block)
        if not stream.remote_ended:  # ask the client to stop sending (RFC 9113 §8.1)
            out += _frame(RST_STREAM, 0, stream.id, _WINDOW.pack(NO_ERROR))
        self._write(out)
        self.streams.pop(stream.id, None)

    def _trailers_only(self, stream_id: int, status: int, message: str) -> None:
        block = _REPLY_HEADERS + _trailers(status, message)
        self._write(_frame(HEADERS, END_STREAM | END_HEADERS, stream_id, block))

    def _fail(self, stream: _Stream, status: int, message: str) -> None:
        log.warning("gRPC stream %d ended: %s", stream.id, message)
        self._end(stream, status, message)
        self._cancel(stream)

    def _cancel(self, stream: _Stream) -> None:
        self.streams.pop(stream.id, None)
        self.blocked.pop(stream.id, None)
        if stream.drained is not None and not stream.drained.done():
            stream.drained.set_result(None)
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()

    # -- the handler's task -----------------------------------------------------------------

    async def _run(self, stream: _Stream) -> None:
        status, message = OK, ""
        try:
            try:
                if stream.method.stream:
                    await stream.method.handler(self._messages(stream), _Replies(self, stream))
                else:
                    await self._unary(stream)
            except GrpcError as error:
                status, message = error.code, error.message
            await self._flush(stream)  # every reply put goes out before the trailers
        except asyncio.CancelledError:
            status, message = CANCELLED, "cancelled"
            if stream.reset or self.transport is None or self.transport.is_closing():
                return  # the peer ended the call: no one to tell
        except Exception:
            log.exception("gRPC handler error on stream %d", stream.id)
            status, message = UNKNOWN, "processor error"
        finally:
            if self.transport is not None and not self.transport.is_closing():
                self._end(stream, status, message)
            self.streams.pop(stream.id, None)

    async def _unary(self, stream: _Stream) -> None:
        request = None
        async for message in self._messages(stream):
            if request is not None:
                raise GrpcError(UNIMPLEMENTED, "a unary method got more than one request")
            request = message
        if request is None:
            raise GrpcError(INTERNAL, "a unary method got no request")
        self._put(stream, await stream.method.handler(request))

    # -- the connection ---------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        """Frames go out together at the end of the loop's turn: the replies one step of a
        handler puts (a request's headers and body replies), and those of the streams that
        ran in the same turn, cost one send and one wake-up of the peer, not one each."""
        if self.transport is None or self.transport.is_closing():
            return
        if self.unsent is None:
            self.unsent = [data]
            self.loop.call_soon(self._send)
        else:
            self.unsent.append(data)

    def _send(self) -> None:
        unsent, self.unsent = self.unsent, None
        if unsent and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(unsent))

    def go_away(self) -> None:
        """Stop: the peer opens no new stream here (the open ones may finish)."""
        self._write(_frame(GOAWAY, 0, 0, _WINDOW.pack(self.last_stream) + _WINDOW.pack(NO_ERROR)))

    def _go_away(self, code: int, reason: str) -> None:
        log.warning("HTTP/2 connection error (%d): %s", code, reason)
        self._write(_frame(GOAWAY, 0, 0, _WINDOW.pack(self.last_stream) + _WINDOW.pack(code) + reason.encode()[:256]))
        self._close()

    def _close(self) -> None:
        if self.transport is not None:
            self._send()  # (the transport still writes what it has before it closes)
            self.transport.close()


class _Replies:
    """A call's outbox on this server (`Outbox`)."""

    __slots__ = ("_connection", "_stream")

    def __init__(self, connection: _Connection, stream: _Stream) -> None:
        self._connection = connection
        self._stream = stream

    def put(self, message: Any) -> None:
        self._connection._put(self._stream, message)

    async def flush(self) -> None:
        await self._connection._flush(self._stream)


class _ConnectionError(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class H2GrpcServer:
    """A gRPC server of `methods` (by path: `/package.Service/Method`) on one TCP address."""

    def __init__(self, methods: dict[str, Method], max_message_bytes: int, stream_window: int = 1 << 20) -> None:
        self.methods = methods
        self.max_message_bytes = max_message_bytes
        self.stream_window = stream_window  # what a stream may send ahead of its handler's reading
        self.connections: set[_Connection] = set()
        self.stopping = False
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port)

    def waiting_bytes(self) -> int:
        """Reply bytes held for peers' flow-control windows."""
        return sum(len(s.pending) for c in self.connections for s in c.streams.values())

    async def stop(self, grace: float) -> None:
        """GOAWAY to every connection; open calls get `grace` seconds, then are cancelled."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.go_away()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while any(c.streams for c in self.connections) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        tasks = [s.task for c in self.connections for s in c.streams.values() if s.task is not None]
        for connection in list(self.connections):
            connection._close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
