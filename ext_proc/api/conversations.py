"""Stored OpenAI Responses as the Responses API serves them: a turn kept after its answer
(`store`, the API's default), found again for the next turn (`previous_response_id`), and the
routes the processor answers itself: `GET /v1/responses/{id}` and `POST .../cancel` as native
vLLM with its store answers them, `DELETE /v1/responses/{id}` and `GET .../input_items` as
OpenAI's API defines them (native vLLM has neither).

A stored response belongs to the tenant whose API key made it: another tenant's id is as
unknown as an id never made. Without a store (`conversation_store.backend: none`) nothing is
kept, as native without `VLLM_ENABLE_RESPONSES_API_STORE`: every id is unknown.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from typing import Any, TypeVar

import orjson

from ext_proc.api.conversation_store import ResponseStore, StoredResponse
from ext_proc.errors import GatewayError

log = logging.getLogger("tito.responses")
T = TypeVar("T")

STORED_HANDLERS = frozenset({"responses_retrieve", "responses_delete", "responses_input_items", "responses_cancel"})
SYNCHRONOUS = "Cannot cancel a synchronous response."  # native's, for a response that is not running


class Conversations:
    """What the process keeps of answered turns: the response store as the Responses API uses
    it (shared by every base model)."""

    def __init__(self, store: ResponseStore | None = None) -> None:
        self.store = store
        # each store operation's outcome (op: put, get, delete; outcome: ok, not_found, error)
        self.on_outcome: Callable[[str, str], None] = lambda op, outcome: None

    @property
    def enabled(self) -> bool:
        return self.store is not None

    def answers(self, handler: str) -> bool:
        """A route the processor answers from what is kept (`listener.routes` handlers)."""
        return handler in STORED_HANDLERS

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()

    async def previous(self, response_id: str, tenant: str | None) -> StoredResponse:
        """The stored turn a follow-up names, or native's 404."""
        found = await self._get(response_id, tenant)
        if found is None:
            raise native_error(404, f"Response with id '{response_id}' not found.", "response_id")
        return found

    async def keep(self, stored: StoredResponse) -> None:
        """Store one turn before its answer's last byte leaves; a failed write is logged and
        counted, and the answer still goes out (its follow-up will not find it)."""
        assert self.store is not None
        try:
            await self.store.put(stored)
        except Exception as exc:  # noqa: BLE001 - the client's answer is not lost for it
            self.on_outcome("put", "error")
            log.error("response %s not stored: %s", stored.id, type(exc).__name__)
        else:
            self.on_outcome("put", "ok")

    async def answer(
        self, handler: str, params: Mapping[str, str], query: Mapping[str, list[str]], tenant: str | None
    ) -> tuple[int, bytes]:
        """A stored-response route's answer: its status and JSON body (`params`: the path's
        `{response_id}`; `query`: its query string, parsed)."""
        response_id = params["response_id"]
        try:
            stored = await self.previous(response_id, tenant)
            if handler == "responses_delete":
                await self._delete(response_id)
                return 200, orjson.dumps({"id": response_id, "object": "response", "deleted": True})
            if handler == "responses_input_items":
                return 200, input_items_page(orjson.loads(stored.input_items), query)
            if handler == "responses_cancel" and orjson.loads(stored.response).get("status") not in _RUNNING:
                raise native_error(400, SYNCHRONOUS, "response_id")
            return 200, stored.response  # (retrieve; a stored response is never running: no background)
        except GatewayError as error:
            return error.status, error.body

    async def _get(self, response_id: str, tenant: str | None) -> StoredResponse | None:
        if self.store is None:
            return None
        found = await self._call("get", self.store.get(response_id))
        found = found if found is not None and found.tenant == tenant else None
        self.on_outcome("get", "ok" if found is not None else "not_found")
        return found

    async def _delete(self, response_id: str) -> None:
        assert self.store is not None
        self.on_outcome("delete", "ok" if await self._call("delete", self.store.delete(response_id)) else "not_found")

    async def _call(self, op: str, call: Awaitable[T]) -> T:
        """A store read or delete; the store unreachable: a 503 for the client, its cause in
        the log (never the id or content)."""
        try:
            return await call
        except Exception as exc:  # noqa: BLE001 - the client gets a 503, the log the cause
            self.on_outcome(op, "error")
            log.error("conversation store unavailable (%s): %s", op, type(exc).__name__)
            raise GatewayError(503, "the response store is unavailable", code="store_unavailable") from exc


_RUNNING = ("queued", "in_progress")


def stored_turn(response: Any, messages: bytes, input_items: bytes, tenant: str | None) -> StoredResponse:
    """One answered turn as it is stored: the answer as retrieve returns it, the messages the
    next turn starts from, the input as `input_items` lists it."""
    body = orjson.dumps(response.model_dump(mode="json", by_alias=True))
    return StoredResponse(response.id, tenant, body, messages, input_items, time.time())


def input_items_page(items: list[dict[str, Any]], query: Mapping[str, list[str]]) -> bytes:
    """OpenAI's list of a response's input items: `order` (desc by default), `after` (an item
    id), `limit` (1-100, default 20)."""
    order = (query.get("order") or ["desc"])[0]
    if order not in ("asc", "desc"):
        raise GatewayError(400, f"Invalid value for 'order': '{order}'", param="order", kind="invalid_request_error")
    try:
        limit = int((query.get("limit") or ["20"])[0])
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise GatewayError(400, "'limit' must be an integer from 1 to 100", param="limit", kind="invalid_request_error")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after:
        ids = [item["id"] for item in ordered]
        ordered = ordered[ids.index(after[0]) + 1 :] if after[0] in ids else []
    page = ordered[:limit]
    return orjson.dumps(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(ordered) > limit,
        }
    )


def native_error(status: int, message: str, param: str) -> GatewayError:
    """Native's `create_error_response(..., err_type="invalid_request_error")`, as its route sends it."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    error = create_error_response(message, "invalid_request_error", HTTPStatus(status), param)
    return GatewayError(status, message, body=orjson.dumps(error.model_dump(mode="json", by_alias=True)))
