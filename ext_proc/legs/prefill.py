"""The Handoff prefill leg, run by the processor before Envoy routes the decode leg.

Non-streaming token-only generate with `max_tokens=1` and `kv_transfer_params =
{do_remote_decode: true, do_remote_prefill: false}`; its answer's `kv_transfer_params` go to
the decode leg unchanged (NIXL pull params; ExampleConnector returns none: decode finds the
KV by prompt). A failed prefill — no answer, a non-200, no params where the pool's
connector needs them — counts on that instance's breaker and is retried on another prefill
instance, a bounded number of times, before anything reaches decode.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
import orjson

from ext_proc.errors import GatewayError
from ext_proc.observability.request import current
from ext_proc.planning.bodies import prefill_body
from ext_proc.planning.plan import Plan, TokenOnly
from ext_proc.planning.planner import Planner
from ext_proc.protocol import GENERATE_PATH

log = logging.getLogger("tito.prefill")
MAX_ATTEMPTS = 3


class PrefillFailed(Exception):
    pass


async def prefilled(plan: TokenOnly, planner: Planner, http: httpx.AsyncClient, timeout_s: float) -> Plan:
    """The plan after its prefill leg: decode's `kv_transfer_params` filled in, or, with no
    prefill anywhere, the request served alone if anything can."""
    try:
        return await handoff(plan, planner, http, timeout_s)
    except GatewayError as error:
        return planner.without_prefill(plan, error)


async def handoff(plan: TokenOnly, planner: Planner, http: httpx.AsyncClient, timeout_s: float) -> TokenOnly:
    """The plan with its prefill leg done: decode's `kv_transfer_params` filled in."""
    tried: list[str] = []
    record = current()
    for attempt in range(MAX_ATTEMPTS):
        leg = plan.prefill
        assert leg is not None
        host = leg.hosts[0]
        trace = {} if record is None else record.leg(leg.lease_id, leg.hosts, "prefill")
        try:
            params = await _prefill(http, host, prefill_body(plan), {"x-request-id": leg.lease_id, **trace}, timeout_s)
            if plan.kv_params_required and not params:
                raise PrefillFailed("no kv_transfer_params in the answer")
        except (PrefillFailed, httpx.HTTPError) as exc:
            log.warning("prefill %s on %s failed: %r", leg.lease_id, host, exc)
            planner.finish(leg.lease_id, failed=(host,))
            if record is not None:
                record.leg_done(leg.lease_id, None, (host,))
            tried.append(host)
            retry = planner.next_prefill(plan, tuple(tried), attempt + 1)
            if retry is None:
                break
            plan = retry
            continue
        except BaseException:  # cancelled (client gone): no verdict
            planner.finish(leg.lease_id)
            raise
        # The prompt's KV is computed (and handed over): the prefill leg's tokens go back.
        planner.finish(leg.lease_id, served_by=host)
        if record is not None:
            record.leg_done(leg.lease_id, host)
        return TokenOnly(plan.tokenized, plan.legs, plan.kv_params_required, params)
    raise GatewayError(503, "no prefill instance could prefill the request", code="prefill_failed")


async def _prefill(
    http: httpx.AsyncClient, host: str, body: bytes, headers: dict[str, str], timeout_s: float
) -> dict[str, Any] | None:
    response = await http.post(
        f"http://{host}{GENERATE_PATH}",
        content=body,
        headers={"content-type": "application/json", **headers},
        timeout=timeout_s,
    )
    if response.status_code != 200:
        raise PrefillFailed(f"HTTP {response.status_code}: {response.text[:200]}")
    try:
        answer = orjson.loads(response.content)
    except orjson.JSONDecodeError as exc:
        raise PrefillFailed("invalid JSON") from exc
    if not isinstance(answer, dict) or not answer.get("choices"):
        raise PrefillFailed("no choices in the answer")
    params = answer.get("kv_transfer_params")
    return params if isinstance(params, dict) else None
