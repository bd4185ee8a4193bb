"""Loading a LoRA adapter on an engine (`lora.on_missing: load`): vLLM's admin route
`/v1/load_lora_adapter` (engines run with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), called by the
gateway on the instance it chose, never reachable from the public listener. One load per
(instance, adapter) at a time: concurrent requests wait for the same call."""

from __future__ import annotations

import asyncio
import logging

import httpx
import orjson

from ext_proc.errors import GatewayError, normalize_error_body
from ext_proc.protocol import Adapter
from scheduler import Scheduler

log = logging.getLogger("tito.lora")
LOAD_PATH = "/v1/load_lora_adapter"


class AdapterLoader:
    def __init__(self, http: httpx.AsyncClient, scheduler: Scheduler, timeout_s: float) -> None:
        self._http = http
        self._scheduler = scheduler
        self._timeout_s = timeout_s
        self._loading: dict[tuple[str, str], asyncio.Future[None]] = {}
        self.loads = 0  # calls made (each adapter once per instance)

    async def load(self, address: str, adapter: Adapter) -> None:
        """The adapter is registered on the instance when this returns; GatewayError (the
        engine's answer) when it could not be loaded."""
        key = (address, adapter.name)
        pending = self._loading.get(key)
        if pending is None:
            pending = self._loading[key] = asyncio.ensure_future(self._load(address, adapter))
            pending.add_done_callback(lambda _: self._loading.pop(key, None))
        await asyncio.shield(pending)  # one caller leaving does not cancel the others' load

    async def _load(self, address: str, adapter: Adapter) -> None:
        self.loads += 1
        body = {"lora_name": adapter.name, "lora_path": adapter.path}
        try:
            response = await self._http.post(f"http://{address}{LOAD_PATH}", json=body, timeout=self._timeout_s)
        except httpx.HTTPError as exc:
            raise GatewayError(502, f"loading adapter {adapter.name!r} on {address} failed: {exc!r}") from exc
        if response.status_code != 200 and not _already_loaded(response):
            log.warning("loading adapter %s on %s: HTTP %d", adapter.name, address, response.status_code)
            status = response.status_code
            raise GatewayError(status, "", body=normalize_error_body(status, response.content))
        log.info("adapter %s loaded on %s", adapter.name, address)
        self._scheduler.lora.add_registered(address, adapter.name)


def _already_loaded(response: httpx.Response) -> bool:
    """vLLM answers 400 for a name it holds already (another gateway process loaded it)."""
    try:
        message = orjson.loads(response.content)["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return False
    return response.status_code == 400 and "has already been loaded" in str(message)
