"""The processor's HTTP client (derender sidecar, native replays, prefill legs, probes),
counting open streams. (Render calls go on their own client: `frontend/render_http.py`.)

A response counts as open from its headers until its body is closed, so `/debug/state` can
prove that no request left an HTTP stream to an engine or the derender sidecar behind.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from ext_proc.config import TitoConfig


class _CountedStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, counter: CountingTransport) -> None:
        self._inner = inner
        self._counter = counter
        self._open = True

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            yield chunk

    async def aclose(self) -> None:
        if self._open:
            self._open = False
            self._counter.open_streams -= 1
        await self._inner.aclose()


class CountingTransport(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self._inner = inner
        self.open_streams = 0
        self.in_flight = 0  # sent, no response headers yet

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.in_flight += 1
        try:
            response = await self._inner.handle_async_request(request)
        finally:
            self.in_flight -= 1
        assert isinstance(response.stream, httpx.AsyncByteStream)
        self.open_streams += 1
        response.stream = _CountedStream(response.stream, self)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def http_client(config: TitoConfig) -> tuple[httpx.AsyncClient, CountingTransport]:
    n = config.processor.http_max_connections
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n, keepalive_expiry=4)  # uvicorn closes at 5 s
    transport = CountingTransport(httpx.AsyncHTTPTransport(limits=limits))
    return httpx.AsyncClient(transport=transport, trust_env=False), transport
