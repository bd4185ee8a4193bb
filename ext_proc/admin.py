"""The processor's admin port: `/health` (the process lives), `/ready` (it can serve: Envoy's
health check of the processor and Kubernetes' readiness probe), `/debug/state` (JSON),
`/debug/stages` (CPU per request stage, with `processor.profile_stages` on),
`/metrics` (Prometheus text, `observability/metrics.py`), and `POST /v1/metaserver` (Trigger
callbacks from decode engines: `legs/trigger.py`).

Tests and operators read the admission ledger, scheduler load, breakers and live streams
here instead of reaching into the process. Deliberately tiny: one response per connection;
never reachable through the public listener.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import parse_qs

import orjson
from prometheus_client import CONTENT_TYPE_LATEST

from ext_proc.legs.trigger import METASERVER_PATH
from ext_proc.services import Services


def state(services: Services) -> dict[str, Any]:
    process, bases = services.process, services.bases
    now = time.monotonic()  # the planners' clock
    schedulers = [base.scheduler.snapshot(now) for base in bases]
    capabilities = [base.capabilities.snapshot() for base in bases if base.capabilities is not None]
    pools = {
        (name if len(bases) == 1 else f"{base.config.model.served_name}/{name}"): pool
        for base in bases
        if base.membership is not None
        for name, pool in base.membership.snapshot().items()
    }
    return {
        "active_exchanges": process.active_exchanges,
        "owned_queue_depth_max": process.owned_queue_depth_max,
        "relays": process.relays,
        "exchanges": [{"request": e.request_id, "mode": e.mode.value} for e in list(process.live)[:20] if not e.closed],
        "open_http_streams": services.http_streams.open_streams + services.http_streams.in_flight,
        "native_replays": process.native_replays,
        "trigger_waiting": sum(len(base.triggers) for base in bases),
        "inflight_bytes": services.inflight.held,
        "tokenization": services.tokenization.snapshot(),
        "render_endpoints": {
            name: e for b in bases for name, e in b.tokenization.snapshot()["render_endpoints"].items()
        },
        "scheduler": _merged(schedulers, ("total_active_tokens", "active_requests", "prefix_index_blocks")),
        "event_loop_lag": services.loop_lag.snapshot(),
        "draining": process.draining,
        "ready": readiness(services),
        **({"capabilities": _merged(capabilities, ("rounds",))} if capabilities else {}),
        "pools": pools,  # each pool's source, and why each instance routes or not
        "flow": _flows([base.planner.flow.snapshot() for base in bases]),  # the admission queue
        **({"quota": quota.snapshot()} if (quota := services.planner.quota) is not None else {}),
        # more than one base model: each one's own
        **(
            {"models": {b.config.model.served_name: _base_state(b, s) for b, s in zip(bases, schedulers, strict=True)}}
            if len(bases) > 1
            else {}
        ),
    }


def _flows(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """Every base's queue as one: totals summed, bands side by side (flows named per base)."""
    merged = _merged(snapshots, ("requests", "tokens", "shed", "timed_out"))
    merged["oldest_wait_s"] = max(s["oldest_wait_s"] for s in snapshots)
    merged["bands"] = {}
    for snapshot in snapshots:
        for band, flows in snapshot["bands"].items():
            merged["bands"].setdefault(band, {}).update(flows)
    return merged


def _base_state(base: Services, scheduler: dict[str, Any]) -> dict[str, Any]:
    return {"tokenization": base.tokenization.snapshot(), "scheduler": scheduler, "ready": _base_ready(base)}


def _merged(snapshots: list[dict[str, Any]], sums: tuple[str, ...]) -> dict[str, Any]:
    """The bases' snapshots as one: the first's settings, totals summed, per-engine entries together."""
    merged = dict(snapshots[0])
    for key in sums:
        merged[key] = sum(snapshot[key] for snapshot in snapshots)
    for key in ("instances", "engines", "render"):
        if key in merged:
            merged[key] = {name: entry for snapshot in snapshots for name, entry in snapshot[key].items()}
    return merged


def readiness(services: Services) -> dict[str, bool]:
    """Each condition of `/ready`, for every base model: not draining; render answers (and
    agrees with the engines' tokenizer) or the local tokenizer can stand in (never with token
    obfuscation); at least one engine may be sent a request, and every pool has one that routes."""
    bases = [_base_ready(base) for base in services.bases]
    return {"serving": not services.process.draining} | {key: all(b[key] for b in bases) for key in bases[0]}


# What a failed check of `/ready` means, in its body.
_UNREADY = {
    "serving": "draining",
    "tokenization": "render is down or disagrees with the engines' tokenizer, and no local tokenizer may stand in",
    "engines": "no engine may be sent a request (every breaker open, or none found)",
}


def unready_reasons(services: Services, checks: dict[str, bool]) -> list[str]:
    """Why `/ready` is 503, one line per failing check (`readiness`'s); the pools without an
    engine that routes are named each, with why every one of its engines is held out."""
    reasons = [f"{check}: {_UNREADY[check]}" for check, ok in checks.items() if not ok and check in _UNREADY]
    for base in services.bases:
        model = f"model {base.config.model.served_name}: " if len(services.bases) > 1 else ""
        if base.capabilities is not None:
            reasons += [f"{model}pool {pool}: {why}" for pool, why in base.capabilities.unready().items()]
    return reasons


def _base_ready(services: Services) -> dict[str, bool]:
    tokenization = services.tokenization.snapshot()
    render_up = (
        services.config.render_config.enable
        and tokenization["render_breaker"] != "open"
        and tokenization["render_held_out"] is None
    )
    fallback = services.config.model.path is not None and services.codec is None
    now = time.monotonic()  # the planner's clock
    return {
        "tokenization": render_up or fallback,
        "engines": _engines_ready(services, now),
        # every pool has an engine whose capability record lets it route
        "capabilities": services.capabilities is None or services.capabilities.ready(),
    }


def _engines_ready(services: Services, now: float) -> bool:
    """Some engine takes requests: its breaker is closed or its cool-down is over (the next
    request is its probe), or with panic routing any engine at all (every breaker open, the
    gateway still routes; readiness says the same, so replicas are not all taken out at once)."""
    breakers = services.scheduler.breakers.values()
    if services.config.scheduler.breaker.panic_when_all_open:
        return bool(breakers)
    return any(not b.is_open(now) for b in breakers)


def _respond(status: str, content_type: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


MAX_CALLBACK_BYTES = 64 * 1024
_STATUS = {
    200: "200 OK",
    400: "400 Bad Request",
    404: "404 Not Found",
    409: "409 Conflict",
    502: "502 Bad Gateway",
    503: "503 Service Unavailable",
}


async def _handle(services: Services, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        request_line = await asyncio.wait_for(reader.readline(), 5)
        parts = request_line.decode("latin-1").split()
        target = parts[1] if len(parts) >= 2 else ""
        path, _, query = target.partition("?")
        length = await _content_length(reader)
        if len(parts) >= 2 and parts[0] == "POST" and path == METASERVER_PATH and length <= MAX_CALLBACK_BYTES:
            body = await asyncio.wait_for(reader.readexactly(length), 5)
            attempt = parse_qs(query).get("attempt", [None])[0]
            try:
                for base in services.bases:  # the base model whose Trigger leg waits for it
                    status, answer = await base.triggers.callback(attempt, body)
                    if status != 404:
                        break
            except asyncio.CancelledError:  # the request's stream ended meanwhile
                status, answer = 404, {"error": "the request is gone"}
            response = _respond(_STATUS.get(status, f"{status} Error"), "application/json", orjson.dumps(answer))
        elif len(parts) < 2 or parts[0] != "GET":
            response = _respond("405 Method Not Allowed", "text/plain", b"GET, or POST /v1/metaserver\n")
        elif path == "/health":
            response = _respond("200 OK", "text/plain", b"ok\n")
        elif path == "/ready":
            checks = readiness(services)
            ready = all(checks.values())
            answer = (
                {"ready": ready, **checks}
                if ready
                else {"ready": False, **checks, "reasons": unready_reasons(services, checks)}
            )
            response = _respond(_STATUS[200 if ready else 503], "application/json", orjson.dumps(answer))
        elif path == "/debug/state":
            response = _respond("200 OK", "application/json", orjson.dumps(state(services)))
        elif path == "/debug/stages" and (stages := services.observability.stages) is not None:
            response = _respond("200 OK", "application/json", orjson.dumps(stages.totals()))
        elif path == "/metrics":
            response = _respond("200 OK", CONTENT_TYPE_LATEST, services.observability.metrics.exposition())
        else:
            response = _respond("404 Not Found", "text/plain", b"not found\n")
        writer.write(response)
        await writer.drain()
    except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def _content_length(reader: asyncio.StreamReader) -> int:
    """Reads the headers; the body's length (0 if none)."""
    length = 0
    while (line := await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        if name.strip().lower() == "content-length" and value.strip().isdigit():
            length = int(value.strip())
    return length


async def start_admin(services: Services, host: str, port: int) -> asyncio.Server:
    return await asyncio.start_server(lambda r, w: _handle(services, r, w), host, port)
