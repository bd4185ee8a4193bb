"""Generate calls the processor makes itself (processor-owned streams): one leg's body goes
to the first of its hosts that answers 200, as Envoy's retries would for a routed leg.

An engine that refuses the connection or answers 5xx/403/404/501 before any output is the next
host's turn and counts against its breaker; any other 4xx is the request's own fault and is
the client's answer at once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from ext_proc.errors import GatewayError, normalize_error_body
from ext_proc.protocol import GENERATE_PATH

JSON = "application/json"
ERROR_BODY_LIMIT = 64 * 1024  # what is read of an engine's error answer
_ENGINE_FAULTS = frozenset({403, 404, 408, 429, 501})  # 4xx that say "not this engine", not "bad request"


@dataclass
class Opened:
    host: str
    response: httpx.Response  # 200, body not read yet: the caller closes it


async def open_generate(
    http: httpx.AsyncClient,
    hosts: Sequence[str],
    body: bytes,
    idle_timeout_s: float,
    failed: list[str],
    trace: dict[str, str] | None = None,
) -> Opened:
    """The leg's generate response from the first host that accepts it; `failed` collects
    the hosts that did not (breaker input). GatewayError when none did. `trace`: the leg's
    `traceparent` (tracing on)."""
    timeout = httpx.Timeout(connect=5.0, read=idle_timeout_s, write=idle_timeout_s, pool=5.0)
    error = GatewayError(503, "no engine instance to serve the request", code="no_healthy_instance")
    for host in hosts:
        request = http.build_request(
            "POST",
            f"http://{host}{GENERATE_PATH}",
            content=body,
            headers={"content-type": JSON, **(trace or {})},
            timeout=timeout,
        )
        try:
            response = await http.send(request, stream=True)
        except httpx.HTTPError as exc:
            failed.append(host)
            error = GatewayError(502, f"engine {host} unreachable: {type(exc).__name__}", code="engine_unavailable")
            continue
        if response.status_code == 200:
            return Opened(host, response)
        try:
            answer = await _head(response)
        finally:
            await response.aclose()
        error = GatewayError(response.status_code, "", body=normalize_error_body(response.status_code, answer))
        if response.status_code < 500 and response.status_code not in _ENGINE_FAULTS:
            raise error
        failed.append(host)
    raise error


async def _head(response: httpx.Response) -> bytes:
    data = bytearray()
    async for piece in response.aiter_raw():
        data += piece
        if len(data) >= ERROR_BODY_LIMIT:
            break
    return bytes(data[:ERROR_BODY_LIMIT])


async def read_whole(opened: Opened, cap: int) -> bytes:
    """A non-streaming generate answer, at most `cap` bytes (over it: 502)."""
    pieces: list[bytes] = []
    size = 0
    try:
        async for piece in opened.response.aiter_raw():
            size += len(piece)
            if size > cap:
                raise GatewayError(502, f"engine response exceeds {cap} bytes", code="engine_response_too_large")
            pieces.append(piece)
    except httpx.HTTPError as exc:
        message = f"engine {opened.host} failed mid-answer: {type(exc).__name__}"
        raise GatewayError(502, message, code="engine_stream_failed") from exc
    return b"".join(pieces)
