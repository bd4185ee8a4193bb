"""The render sidecar's HTTP client: POSTs of JSON bodies over kept-alive HTTP/1.1
connections, on asyncio protocols.

Every request pays render's call before anything else, so its client is on the hot path:
httpx (with httpcore and anyio under it) spent 1.3 ms of event-loop CPU per render call,
as much as rendering in process (`tests/bench/start_profile.py`); this one writes the
request in one call and parses the answer as it arrives. It speaks only what vLLM's render
server (uvicorn) answers: a status line, headers, and a body framed by `content-length`,
chunked, or the connection's end.

A request goes on an idle connection if one is kept, else on a new one. A kept connection
the server closed before answering (uvicorn ends idle ones after 5 s) is retried once on a
new one: render changes nothing, so a request is safe to send again.
"""

from __future__ import annotations

import asyncio
from typing import cast
from urllib.parse import urlsplit

MAX_IDLE = 64  # kept-alive connections per endpoint (beyond it: closed after use)
MAX_HEAD_BYTES = 64 * 1024


class HttpFailure(Exception):
    """The endpoint could not be reached, or its answer is not HTTP."""


class _Stale(HttpFailure):
    """A kept-alive connection closed before any byte of the answer came."""


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._answer: asyncio.Future[tuple[int, bytes, bool]] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._answer is None or self._answer.done():
            return
        try:
            parsed = _parse(self._buffer, eof=False)
        except HttpFailure as exc:
            self._answer.set_exception(exc)
            return
        if parsed is not None:
            self._answer.set_result(parsed)

    def eof_received(self) -> bool | None:
        self._ended(None)
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended(exc)

    def _ended(self, exc: Exception | None) -> None:
        self.closed = True
        answer = self._answer
        if answer is None or answer.done():
            return
        if not self._buffer:
            answer.set_exception(_Stale(f"the connection closed before an answer ({exc!r})"))
            return
        try:  # an answer framed by the connection's end
            parsed = _parse(self._buffer, eof=True)
        except HttpFailure as failure:
            answer.set_exception(failure)
            return
        if parsed is None:
            answer.set_exception(HttpFailure("the connection closed mid-answer"))
        else:
            answer.set_result(parsed)

    async def exchange(self, request: bytes) -> tuple[int, bytes, bool]:
        """(status, body, whether the connection may be used again)."""
        assert self._transport is not None
        self._buffer.clear()
        self._answer = asyncio.get_running_loop().create_future()
        self._transport.write(request)
        return await self._answer

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()


def _parse(buffer: bytearray, eof: bool) -> tuple[int, bytes, bool] | None:
    """The whole answer in `buffer`, or None while more is to come."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        if len(buffer) > MAX_HEAD_BYTES or eof:
            raise HttpFailure("no HTTP response head")
        return None
    lines = bytes(buffer[:end]).split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code = rest[:3]
    if not version.startswith(b"HTTP/1.") or not code.isdigit():
        raise HttpFailure(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip().lower()
    keep = headers.get(b"connection") != b"close" and version == b"HTTP/1.1"
    body_start = end + 4
    if b"chunked" in headers.get(b"transfer-encoding", b""):
        body = _dechunked(buffer, body_start)
        return None if body is None else (int(code), body, keep)
    if (length := headers.get(b"content-length")) is not None:
        if not length.isdigit():
            raise HttpFailure(f"a bad content-length: {length[:40]!r}")
        if len(buffer) - body_start < int(length):
            return None
        return int(code), bytes(buffer[body_start : body_start + int(length)]), keep
    if int(code) in (204, 304) or int(code) < 200:
        return int(code), b"", keep
    return (int(code), bytes(buffer[body_start:]), False) if eof else None


def _dechunked(buffer: bytearray, at: int) -> bytes | None:
    body = bytearray()
    while True:
        line_end = buffer.find(b"\r\n", at)
        if line_end < 0:
            return None
        size_text = bytes(buffer[at:line_end]).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise HttpFailure(f"a bad chunk size: {size_text[:40]!r}") from None
        if size == 0:  # (trailers, if any, end with an empty line)
            return bytes(body) if buffer.find(b"\r\n\r\n", line_end) >= 0 else None
        start = line_end + 2
        if len(buffer) < start + size + 2:
            return None
        body += buffer[start : start + size]
        at = start + size + 2


class RenderHttp:
    """One endpoint's connections (`url`: http://host:port), at most `max_connections` at
    once (more requests wait for one, as httpx's pool made them)."""

    def __init__(self, url: str, max_connections: int = 256) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"render endpoints are plain http://host:port, not {url!r}")
        self._host, self._port = parts.hostname, parts.port or 80
        self._authority = parts.netloc.encode()
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(max_connections)

    async def post(self, path: str, body: bytes, request_id: str, timeout: float) -> tuple[int, bytes]:
        """(status, body) of a JSON POST; TimeoutError, or HttpFailure (or OSError) when the
        endpoint cannot answer."""
        head = (
            b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nx-request-id: %s\r\n\r\n"
        ) % (path.encode(), self._authority, len(body), request_id.encode())
        async with asyncio.timeout(timeout), self._slots:
            while True:
                kept = self._take()
                connection = kept or await self._connect()
                try:
                    status, answer, keep = await connection.exchange(head + body)
                except _Stale:
                    connection.close()
                    if kept is None:  # a new connection: the endpoint's doing
                        raise
                    continue
                except BaseException:  # cancelled, timed out, or a broken answer: its state is unknown
                    connection.close()
                    raise
                break
        if keep and len(self._idle) < MAX_IDLE:
            self._idle.append(connection)
        else:
            connection.close()
        return status, answer

    def _take(self) -> _Connection | None:
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed:
                return connection
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        _, connection = await loop.create_connection(_Connection, self._host, self._port)
        return connection

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()
