"""The render sidecar's HTTP client (`ext_proc/frontend/render_http.py`) against real
loopback servers that answer as scripted: every framing uvicorn uses, kept-alive
connections reused, a kept connection the server closed retried once on a new one, and
timeouts, drops and non-HTTP answers as failures that leave nothing open."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from ext_proc.frontend.render_http import HttpFailure, RenderHttp

Answer = Callable[[bytes], bytes | None]  # the request's body -> raw answer bytes (None: drop)


class Server:
    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []  # (head, body)
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.startswith(b"content-length")
                )
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                if (raw := self.answer(body)) is None:
                    return
                writer.write(raw)
                await writer.drain()
                if raw.startswith(b"HTTP/1.0"):  # framed by the connection's end
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def drop_idle(self) -> None:
        """As uvicorn ends kept-alive connections after 5 s idle."""
        for writer in self._writers:
            writer.close()

    def close(self) -> None:
        assert self._server is not None
        self._server.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Answer], Server]]:
    servers: list[Server] = []

    def make(answer: Answer) -> Server:
        servers.append(Server(answer))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def _sized(body: bytes, status: int = 200) -> bytes:
    return b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status,
        len(body),
        body,
    )


async def test_a_post_gets_status_and_body_and_the_connection_is_kept(serve: Callable[[Answer], Server]) -> None:
    server = serve(lambda body: _sized(b'{"echo":' + body + b"}", 400))
    client = RenderHttp(await server.start())
    for n in range(3):
        assert await client.post("/v1/chat/completions/render", b"[%d]" % n, "rid", 5) == (400, b'{"echo":[%d]}' % n)
    assert server.connections == 1
    head, body = server.requests[0]
    assert head.startswith(b"POST /v1/chat/completions/render HTTP/1.1\r\n") and b"x-request-id: rid\r\n" in head
    assert b"content-type: application/json\r\n" in head and body == b"[0]"
    client.close()


async def test_chunked_and_close_framed_answers(serve: Callable[[Answer], Server]) -> None:
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n"
    server = serve(lambda body: chunked)
    client = RenderHttp(await server.start())
    assert await client.post("/r", b"{}", "a", 5) == (200, b"abcde")
    assert await client.post("/r", b"{}", "a", 5) == (200, b"abcde")
    assert server.connections == 1
    unframed = serve(lambda body: b"HTTP/1.0 200 OK\r\n\r\nuntil the end")
    client = RenderHttp(await unframed.start())
    assert await asyncio.wait_for(client.post("/r", b"{}", "a", 5), 5) == (200, b"until the end")


async def test_an_answer_split_across_packets_is_assembled(serve: Callable[[Answer], Server]) -> None:
    whole = _sized(b"x" * 200_000)
    server = serve(lambda body: whole)
    client = RenderHttp(await server.start())
    assert await client.post("/r", b"{}", "a", 5) == (200, b"x" * 200_000)


async def test_a_kept_connection_the_server_closed_is_retried_on_a_new_one(serve: Callable[[Answer], Server]) -> None:
    server = serve(lambda body: _sized(b"ok"))
    client = RenderHttp(await server.start())
    assert await client.post("/r", b"{}", "a", 5) == (200, b"ok")
    server.drop_idle()
    await asyncio.sleep(0.05)
    assert await client.post("/r", b"{}", "b", 5) == (200, b"ok")
    assert server.connections == 2


async def test_a_kept_connection_dropped_in_flight_is_retried_once(serve: Callable[[Answer], Server]) -> None:
    answers = iter([_sized(b"first"), None, _sized(b"again")])
    server = serve(lambda body: next(answers))
    client = RenderHttp(await server.start())
    assert await client.post("/r", b"{}", "a", 5) == (200, b"first")
    assert await client.post("/r", b"{}", "b", 5) == (200, b"again")  # the drop came before any byte
    assert server.connections == 2


async def test_a_new_connection_dropped_before_an_answer_fails(serve: Callable[[Answer], Server]) -> None:
    server = serve(lambda body: None)
    client = RenderHttp(await server.start())
    with pytest.raises(HttpFailure):
        await client.post("/r", b"{}", "a", 5)
    assert len(server.requests) == 1  # not sent twice: the endpoint itself refuses


@pytest.mark.parametrize(
    "raw",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",  # then the connection ends
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
    ],
)
async def test_what_is_not_a_whole_http_answer_fails(serve: Callable[[Answer], Server], raw: bytes) -> None:
    server = serve(lambda body: raw)
    client = RenderHttp(await server.start())

    async def answer_then_close() -> None:
        await asyncio.sleep(0.1)
        server.drop_idle()

    closer = asyncio.create_task(answer_then_close())
    with pytest.raises(HttpFailure):
        await client.post("/r", b"{}", "a", 5)
    await closer


async def test_a_timeout_drops_the_connection(serve: Callable[[Answer], Server]) -> None:
    answers = iter([b"", _sized(b"late")])  # the first request is never answered
    server = serve(lambda body: next(answers))
    client = RenderHttp(await server.start())
    with pytest.raises(TimeoutError):
        await client.post("/r", b"{}", "a", 0.2)
    assert await client.post("/r", b"{}", "b", 5) == (200, b"late")
    assert server.connections == 2  # the timed-out connection was not reused


async def test_connection_close_is_not_kept(serve: Callable[[Answer], Server]) -> None:
    server = serve(lambda body: b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok")
    client = RenderHttp(await server.start())
    assert await client.post("/r", b"{}", "a", 5) == (200, b"ok")
    assert await client.post("/r", b"{}", "a", 5) == (200, b"ok")
    assert server.connections == 2


async def test_nothing_listening_is_an_os_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(OSError):
        await RenderHttp(f"http://127.0.0.1:{port}").post("/r", b"{}", "a", 5)


def test_under_uvloop_as_the_processor_runs() -> None:
    """The processor's loop is uvloop, whose transports are not asyncio's classes."""
    import uvloop

    async def scenario() -> None:
        server = Server(lambda body: _sized(b"ok"))
        client = RenderHttp(await server.start())
        try:
            assert await client.post("/r", b"{}", "a", 5) == (200, b"ok")
            assert await client.post("/r", b"{}", "b", 5) == (200, b"ok")
            assert server.connections == 1
        finally:
            client.close()
            server.close()

    uvloop.run(scenario())


async def test_requests_beyond_the_connection_cap_wait_for_one(serve: Callable[[Answer], Server]) -> None:
    server = serve(lambda body: _sized(body))
    client = RenderHttp(await server.start(), max_connections=1)
    answers = await asyncio.gather(*(client.post("/r", b"%d" % n, "a", 5) for n in range(4)))
    assert sorted(answers) == [(200, b"%d" % n) for n in range(4)]
    assert server.connections == 1
