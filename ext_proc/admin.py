"""The processor's admin port: `/health`, `/debug/state` (JSON) and `/metrics` (Prometheus text).

Tests and operators read the admission ledger, scheduler load, breakers and live streams
here instead of reaching into the process. Deliberately tiny: GET only, one response per
connection, nothing on the request path.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from ext_proc.services import Services


def state(services: Services) -> dict[str, Any]:
    return {
        "active_exchanges": services.active_exchanges,
        "open_http_streams": services.http_streams.open_streams + services.http_streams.in_flight,
        "native_replays": services.native_replays,
        "inflight_bytes": services.inflight.held,
        "tokenization": services.tokenization.snapshot(),
        "scheduler": services.scheduler.snapshot(),
        "event_loop_lag": services.loop_lag.snapshot(),
    }


def metrics(services: Services) -> str:
    snapshot = services.scheduler.snapshot()
    lag = services.loop_lag.snapshot()
    lines = [
        "# TYPE tito_event_loop_lag_p99_ms gauge",
        f"tito_event_loop_lag_p99_ms {lag['p99_ms']}",
        "# TYPE tito_event_loop_lag_max_ms gauge",
        f"tito_event_loop_lag_max_ms {lag['max_ms']}",
        "# TYPE tito_active_exchanges gauge",
        f"tito_active_exchanges {services.active_exchanges}",
        "# TYPE tito_admitted_tokens gauge",
        f"tito_admitted_tokens {snapshot['total_active_tokens']}",
        "# TYPE tito_instance_active_tokens gauge",
    ]
    for address, instance in snapshot["instances"].items():
        lines.append(f'tito_instance_active_tokens{{instance="{address}"}} {instance["active_tokens"]}')
    lines.append("# TYPE tito_instance_breaker_open gauge")
    for address, instance in snapshot["instances"].items():
        lines.append(f'tito_instance_breaker_open{{instance="{address}"}} {int(instance["breaker"] != "closed")}')
    return "\n".join(lines) + "\n"


def _respond(status: str, content_type: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


async def _handle(services: Services, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        request_line = await asyncio.wait_for(reader.readline(), 5)
        parts = request_line.decode("latin-1").split()
        path = parts[1].split("?", 1)[0] if len(parts) >= 2 else ""
        if len(parts) < 2 or parts[0] != "GET":
            response = _respond("405 Method Not Allowed", "text/plain", b"GET only\n")
        elif path == "/health":
            response = _respond("200 OK", "text/plain", b"ok\n")
        elif path == "/debug/state":
            response = _respond("200 OK", "application/json", orjson.dumps(state(services)))
        elif path == "/metrics":
            response = _respond("200 OK", "text/plain; version=0.0.4", metrics(services).encode())
        else:
            response = _respond("404 Not Found", "text/plain", b"not found\n")
        writer.write(response)
        await writer.drain()
    except (TimeoutError, ConnectionError):
        pass
    finally:
        writer.close()


async def start_admin(services: Services, host: str, port: int) -> asyncio.Server:
    return await asyncio.start_server(lambda r, w: _handle(services, r, w), host, port)
