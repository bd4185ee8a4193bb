"""Derender: generate output (token ids) -> OpenAI responses, through the render sidecar.

One pipeline for every transport: `StreamDerender` takes the raw SSE bytes of one prompt's
generate stream, however they arrive (Envoy body chunks, or an engine stream the processor
owns), and returns OpenAI SSE bytes. `derender_response` does the same for a whole
non-streaming GenerateResponse. Derender failures never re-run inference.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from ext_proc.config import RenderConfig
from ext_proc.errors import GatewayError, error_payload
from ext_proc.protocol import ApiKind, TokenizedRequest
from ext_proc.streaming import DONE, DONE_EVENT, SSEFramer, sse_event


class DerenderClient:
    def __init__(self, config: RenderConfig, http: httpx.AsyncClient, served_name: str, has_parser: bool) -> None:
        self._base = config.endpoint.url
        self._timeout = config.timeout_ms / 1000
        self._http = http
        self.served_name = served_name
        # With a reasoning/tool parser, derender replays the output and needs the full
        # prompt ids on every call; without one, only the first call seeds the detokenizer.
        self.prompt_ids_every_call = has_parser

    async def call(self, path: str, body: bytes) -> dict[str, Any]:
        try:
            response = await self._http.post(
                self._base + path, content=body, headers={"content-type": "application/json"}, timeout=self._timeout
            )
        except httpx.TimeoutException as exc:
            raise GatewayError(504, f"derender timed out: {exc!r}", code="derender_timeout") from exc
        except httpx.HTTPError as exc:
            raise GatewayError(502, f"derender unavailable: {exc!r}", code="derender_unavailable") from exc
        if response.status_code != 200:
            raise _derender_error(response)
        try:
            parsed = orjson.loads(response.content)
        except orjson.JSONDecodeError as exc:
            raise GatewayError(502, "derender returned invalid JSON", code="derender_invalid") from exc
        if not isinstance(parsed, dict):
            raise GatewayError(502, "derender returned no JSON object", code="derender_invalid")
        return parsed


def _derender_error(response: httpx.Response) -> GatewayError:
    status = response.status_code
    try:
        detail = orjson.loads(response.content)["error"]["message"]
    except Exception:  # noqa: BLE001 - any non-OpenAI body: keep its text
        detail = response.text[:500]
    if status in (400, 422):
        return GatewayError(status, f"derender rejected the output: {detail}", code="derender_rejected")
    if status in (404, 501):
        return GatewayError(501, f"derender unsupported: {detail}", code="derender_unsupported")
    return GatewayError(502, f"derender failed with HTTP {status}: {detail}", code="derender_failed")


def _static_fields(client: DerenderClient, request: TokenizedRequest) -> bytes:
    """The per-request part of every derender call, serialized once."""
    return (
        b',"model":'
        + orjson.dumps(client.served_name)
        + b',"'
        + request.api.client_request_key.encode()
        + b'":'
        + request.request.raw
    )


async def derender_response(client: DerenderClient, request: TokenizedRequest, generate_body: bytes) -> bytes:
    """One derender of a whole non-streaming GenerateResponse -> the OpenAI JSON body."""
    prompt = request.prompts[0]
    if request.api is ApiKind.CHAT:
        body = (
            b'{"generate_response":'
            + generate_body
            + b',"prompt_tokens":'
            + orjson.dumps(len(prompt.token_ids))
            + b',"prompt_token_ids":'
            + orjson.dumps(prompt.token_ids)
        )
    else:
        body = (
            b'{"generate_responses":['
            + generate_body
            + b'],"prompt_tokens":'
            + orjson.dumps([len(p.token_ids) for p in request.prompts])
            + b',"prompt_token_ids":'
            + orjson.dumps([p.token_ids for p in request.prompts])
        )
    result = await client.call(request.api.derender_path, body + _static_fields(client, request) + b"}")
    result["id"] = request.request_id
    return orjson.dumps(result)


class StreamDerender:
    """One prompt's generate SSE stream in, OpenAI SSE out; one `stream_state` per choice.

    A state advances only after derender succeeded for its chunk. Exactly one `[DONE]` is
    emitted, after an in-band engine error or a derender failure too (as an error event).
    """

    def __init__(self, client: DerenderClient, request: TokenizedRequest, prompt_index: int = 0) -> None:
        self._client = client
        self._request = request
        self._prompt = request.prompts[prompt_index]
        self._framer = SSEFramer()
        self._states: dict[int, Any] = {}
        self._static = (
            b',"prompt_tokens":' + orjson.dumps(len(self._prompt.token_ids)) + _static_fields(client, request) + b"}"
        )
        self._prompt_ids = b',"prompt_token_ids":' + orjson.dumps(self._prompt.token_ids)
        self.done = False

    async def feed(self, raw: bytes) -> bytes:
        out = bytearray()
        for payload in self._framer.feed(raw):
            out += await self._event(payload)
        return bytes(out)

    async def finish(self) -> bytes:
        """End of the generate stream: whatever is left, and the one `[DONE]`."""
        out = bytearray()
        for payload in self._framer.flush():
            out += await self._event(payload)
        if not self.done:
            self.done = True
            out += DONE_EVENT
        return bytes(out)

    async def _event(self, payload: bytes) -> bytes:
        if self.done:
            return b""
        if payload == DONE:
            self.done = True
            return DONE_EVENT
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return self._fail(502, "engine sent an invalid stream event", "engine_invalid_event")
        if "error" in event:
            error = event["error"] if isinstance(event["error"], dict) else {"message": str(event["error"])}
            return self._fail(500, str(error.get("message", "engine error")), error.get("code") or "engine_error")
        choices = event.get("choices") or []
        index = choices[0].get("index", 0) if choices else -1
        try:
            result = await self._client.call(self._request.api.derender_path, self._body(payload, index))
        except GatewayError as exc:
            return self._fail(exc.status, exc.message, exc.code)
        chunk = result.get("chunk")
        if not isinstance(chunk, dict):
            return self._fail(502, "derender returned no chunk", "derender_invalid")
        if index >= 0:
            self._states[index] = result.get("stream_state")
        chunk["id"] = self._request.request_id
        return sse_event(orjson.dumps(chunk))

    def _body(self, payload: bytes, index: int) -> bytes:
        body = b'{"stream":true,"generate_chunk":' + payload
        body += b',"stream_state":' + orjson.dumps(self._states.get(index))
        if self._client.prompt_ids_every_call or self._states.get(index) is None:
            body += self._prompt_ids
        return body + self._static

    def _fail(self, status: int, message: str, code: str | int | None) -> bytes:
        self.done = True
        return sse_event(orjson.dumps(error_payload(status, message, code=code))) + DONE_EVENT
