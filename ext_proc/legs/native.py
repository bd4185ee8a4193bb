"""The native path: the client's original OpenAI body on an engine's own endpoint.

Routed through Envoy when the request cannot go token-only (local-tokenizer fallback,
multi-prompt for now, an instance known to lack token-only generate); replayed by the
processor itself when an engine answers 404/501 to `/inference/v1/generate` before any
output (RFC fault table, "token-only Engine 能力").
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import orjson

from ext_proc.envoy_protocol.messages import HIDDEN_RESPONSE_HEADERS, JSON, response_body_reply, response_headers_reply
from ext_proc.errors import error_body
from ext_proc.protocol import NOT_FOR_ENGINES, OpenAIRequest
from protos.stubs import ext_proc_pb

# What an engine without `/inference/v1/generate` answers (route missing / not implemented).
UNSUPPORTED_STATUSES = frozenset({404, 501})


def native_body(request: OpenAIRequest, raw: bytes) -> bytes:
    """The client's body for an engine's own endpoint: as sent, unless it carries fields an
    engine must not get (then re-encoded without them)."""
    if any(key in request.body for key in NOT_FOR_ENGINES):
        return orjson.dumps(request.engine_body())
    return raw


def token_only_unsupported(status: int, body: bytes) -> bool:
    """404/501 from generate, unless it is the engine's verdict on the request's model."""
    if status not in UNSUPPORTED_STATUSES:
        return False
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return True
    return not (isinstance(error, dict) and error.get("param") == "model")


async def replay_native(
    http: httpx.AsyncClient, address: str, request: OpenAIRequest, idle_timeout_s: float, end_of_stream: bool
) -> AsyncIterator[ext_proc_pb.ProcessingResponse]:
    """The engine's native answer as the response Envoy sends on: headers, then its body as it comes."""
    timeout = httpx.Timeout(connect=5.0, read=idle_timeout_s, write=idle_timeout_s, pool=5.0)
    headers_sent = False
    try:
        async with http.stream(
            "POST",
            f"http://{address}{request.api.value}",
            content=orjson.dumps(request.engine_body()),
            headers={"content-type": JSON},
            timeout=timeout,
        ) as response:
            content_type = response.headers.get("content-type", JSON)
            yield response_headers_reply(
                set_headers={":status": str(response.status_code), "content-type": content_type},
                remove=HIDDEN_RESPONSE_HEADERS,
            )
            headers_sent = True
            async for chunk in response.aiter_raw():
                if chunk:
                    yield response_body_reply(chunk, False)
    except httpx.HTTPError as exc:
        if not headers_sent:
            message = f"native replay on {address} failed: {exc!r}"
            yield response_headers_reply(
                set_headers={":status": "502", "content-type": JSON}, remove=HIDDEN_RESPONSE_HEADERS
            )
            yield response_body_reply(error_body(502, message, code="native_replay_failed"), end_of_stream)
            return
    yield response_body_reply(b"", end_of_stream)
