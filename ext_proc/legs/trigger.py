"""Trigger (decode first, layer-wise KV sync): the decode leg goes out first, through Envoy,
with a metaserver URL in its `kv_transfer_params`; when the decode engine is ready for the
KV it POSTs `{request_id, kv_transfer_params}` to that URL (`?attempt=N`), and the gateway
then sends the prefill leg: the callback's params with `do_remote_decode: true`,
`do_remote_prefill: false`, no `metaserver`, `max_tokens = min_tokens = 1`. An unknown
request is a 404, a stale attempt a 409. The prefill leg's tokens go back at the first decode
chunk (MindIE Motor's rule: prefill may answer before the KV has moved).

The metaserver is served on the processor's admin port, never on the public listener.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from ext_proc.frontend.token_only import generate_body
from ext_proc.planning.plan import Leg, TokenOnly
from ext_proc.planning.planner import Planner
from ext_proc.protocol import GENERATE_PATH

log = logging.getLogger("tito.trigger")
METASERVER_PATH = "/v1/metaserver"
ENGINE_ID_PREFIX = "generate-tokens-"  # what an engine calls a generate request internally

Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]


@dataclass
class _Waiting:
    plan: TokenOnly
    attempt: int
    spawn: Spawn  # runs the prefill leg among the stream's own tasks (cancelled with it)
    prefill: Leg | None = None


class Triggers:
    """The decode legs waiting for their engine's callback, by lease id."""

    def __init__(self, planner: Planner, http: httpx.AsyncClient, timeout_s: float) -> None:
        self._planner = planner
        self._http = http
        self._timeout_s = timeout_s
        self._waiting: dict[str, _Waiting] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def expect(self, plan: TokenOnly, spawn: Spawn) -> None:
        self._waiting[plan.routed.lease_id] = _Waiting(plan, plan.trigger_attempt or 0, spawn)

    def first_chunk(self, lease_id: str) -> None:
        """Decode produced output: the prefill leg is done, its tokens go back."""
        waiting = self._waiting.get(lease_id)
        if waiting is not None and waiting.prefill is not None:
            self._planner.finish(waiting.prefill.lease_id, served_by=waiting.prefill.hosts[0])
            waiting.prefill = None

    def forget(self, lease_id: str) -> None:
        waiting = self._waiting.pop(lease_id, None)
        if waiting is not None and waiting.prefill is not None:
            self._planner.finish(waiting.prefill.lease_id)

    async def callback(self, attempt: str | None, body: bytes) -> tuple[int, dict[str, Any]]:
        """The decode engine's POST to the metaserver: (status, JSON answer)."""
        try:
            call = orjson.loads(body)
            request_id = str(call["request_id"])
            params = dict(call.get("kv_transfer_params") or {})
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return 400, {"error": "expected {request_id, kv_transfer_params}"}
        waiting = self._waiting.get(request_id.removeprefix(ENGINE_ID_PREFIX))
        if waiting is None:
            return 404, {"error": f"unknown request {request_id}"}
        if attempt != str(waiting.attempt) or waiting.prefill is not None:
            return 409, {"error": f"stale attempt {attempt} (current {waiting.attempt})"}
        answer: tuple[int, dict[str, Any]] = await waiting.spawn(self._prefill(waiting, params))
        return answer

    async def _prefill(self, waiting: _Waiting, params: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        leg = self._planner.trigger_prefill(waiting.plan)
        if leg is None:
            return 503, {"error": "no healthy prefill instance"}
        forced = {k: v for k, v in params.items() if k != "metaserver"}
        forced |= {"do_remote_decode": True, "do_remote_prefill": False}
        beside_k = waiting.plan.tokenized.shows_sampled_beside_k
        body = generate_body(
            leg.prompt, 1, beside_k, request_id=leg.lease_id, prefill=True, kv_transfer_params=forced, min_tokens=1
        )
        host = leg.hosts[0]
        try:
            response = await self._http.post(
                f"http://{host}{GENERATE_PATH}",
                content=body,
                headers={"content-type": "application/json", "x-request-id": leg.lease_id},
                timeout=self._timeout_s,
            )
        except httpx.HTTPError as exc:
            log.warning("trigger prefill %s on %s failed: %r", leg.lease_id, host, exc)
            self._planner.finish(leg.lease_id, failed=(host,))
            return 502, {"error": "prefill failed"}
        except BaseException:
            self._planner.finish(leg.lease_id)
            raise
        if response.status_code != 200:
            self._planner.finish(leg.lease_id, failed=(host,))
            return 502, {"error": f"prefill answered HTTP {response.status_code}"}
        waiting.prefill = leg  # its tokens go back at decode's first chunk
        return 200, {"status": "ok"}
