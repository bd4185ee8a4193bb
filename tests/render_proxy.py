"""A fault-injecting proxy in front of the real vLLM render server.

Render stays real (render, derender and their verdicts come from vLLM); the proxy only adds
what a test needs on cue: a status instead of the answer, a stall, an invalid body, or no
listener at all (`stop()`). It records every call so tests can assert what reached render
(the gateway's capability probes aside).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ext_proc.frontend.render_pool import HEALTH_REQUEST_ID
from tests.servers import ThreadedServer


@dataclass
class RenderFault:
    """`target`: "render" or "derender" (the path suffix). kinds: `status` (answer `status`
    with `body`), `stall` (never answer), `invalid_body` (200 without token_ids), `delay`
    (answer after `delay_s`: a slow, saturated endpoint).
    `stream`: for derender, hit only streaming (True) or batch (False) calls; None: both."""

    target: str
    kind: str
    status: int = 503
    body: bytes = b"simulated render failure"
    stream: bool | None = None
    times: int | None = None
    delay_s: float = 0.0


@dataclass
class Call:
    path: str
    fault: str | None


@dataclass
class RenderProxy:
    upstream: str
    faults: list[RenderFault] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)

    def calls_to(self, target: str) -> list[Call]:
        return [c for c in self.calls if c.path.endswith("/" + target)]

    def _fault_for(self, path: str, body: bytes) -> RenderFault | None:
        for fault in self.faults:
            if not path.endswith("/" + fault.target):
                continue
            if fault.stream is not None and (b'"stream":true' in body.replace(b" ", b"")) != fault.stream:
                continue
            if fault.times is not None:
                fault.times -= 1
                if fault.times <= 0:
                    self.faults.remove(fault)
            return fault
        return None

    async def handle(self, request: Request) -> Response:
        body = await request.body()
        # the gateway's capability probes and the render pool's health renders pass untouched
        # and unrecorded: faults are for requests
        probe = request.headers.get("user-agent") == "tito-capabilities"
        probe = probe or request.headers.get("x-request-id") == HEALTH_REQUEST_ID
        fault = None if probe else self._fault_for(request.url.path, body)
        if not probe:
            self.calls.append(Call(request.url.path, fault.kind if fault else None))
        if fault is not None and fault.kind == "status":
            return Response(fault.body, status_code=fault.status, media_type="application/json")
        if fault is not None and fault.kind == "stall":
            await asyncio.Event().wait()
        if fault is not None and fault.kind == "delay":
            await asyncio.sleep(fault.delay_s)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "x-request-id")}
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            upstream = await client.request(
                request.method, self.upstream + request.url.path, content=body, headers=headers
            )
        if fault is not None and fault.kind == "invalid_body":
            return JSONResponse({"request_id": "broken", "sampling_params": {}})
        return Response(
            upstream.content, status_code=upstream.status_code, media_type=upstream.headers.get("content-type")
        )

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/{path:path}", self.handle, methods=["GET", "POST"])])


class RenderProxyServer(ThreadedServer):
    def __init__(self, proxy: RenderProxy) -> None:
        super().__init__(proxy.app())
        self.proxy = proxy
