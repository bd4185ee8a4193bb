"""Render client: OpenAI request -> token-only GenerateRequest(s), through the render sidecar."""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from ext_proc.config import RenderConfig
from ext_proc.errors import GatewayError, normalize_error_body
from ext_proc.protocol import OpenAIRequest, PromptTokens, TokenizedRequest

# Render's own verdicts on the request: the client gets them unchanged.
CLIENT_ERROR_STATUSES = frozenset({400, 404, 422})


class RenderClient:
    def __init__(self, config: RenderConfig, http: httpx.AsyncClient) -> None:
        self._base = config.endpoint.url
        self._timeout = config.timeout_ms / 1000
        self._http = http

    async def render(self, request: OpenAIRequest, request_id: str) -> TokenizedRequest:
        try:
            response = await self._http.post(
                self._base + request.api.render_path,
                content=request.raw,
                headers={"content-type": "application/json", "x-request-id": request_id},
                timeout=self._timeout,
            )
        except httpx.TimeoutException as exc:
            raise GatewayError(504, f"render timed out: {exc!r}", code="render_timeout") from exc
        except httpx.HTTPError as exc:
            raise GatewayError(503, f"render unavailable: {exc!r}", code="render_unavailable") from exc
        if response.status_code in CLIENT_ERROR_STATUSES:
            raise GatewayError(
                response.status_code,
                "render rejected the request",
                body=normalize_error_body(response.status_code, response.content),
            )
        if response.status_code != 200:
            raise GatewayError(502, f"render failed with HTTP {response.status_code}", code="render_failed")
        return _tokenized(request, response.content)


def _tokenized(request: OpenAIRequest, body: bytes) -> TokenizedRequest:
    try:
        parsed: Any = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise GatewayError(502, "render returned invalid JSON", code="render_invalid") from exc
    generate_requests = parsed if isinstance(parsed, list) else [parsed]
    prompts = []
    for item in generate_requests:
        if not (
            isinstance(item, dict)
            and isinstance(item.get("token_ids"), list)
            and item["token_ids"]
            and isinstance(item.get("sampling_params"), dict)
        ):
            raise GatewayError(502, "render returned no token_ids/sampling_params", code="render_invalid")
        prompts.append(PromptTokens(item))
    return TokenizedRequest(request=request, request_id=str(prompts[0].generate_request["request_id"]), prompts=prompts)
