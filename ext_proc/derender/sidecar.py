"""Derender through the render sidecar (`/…/derender`): the RFC baseline and the parity oracle.

One HTTP call per generate event with a `stream_state` per choice (vLLM 0.32 replays the
whole output on every call when a parser is configured), one call per whole response. Two
places where 0.32's derender differs from native serving are corrected here, with the
gateway's own tokenizer: a non-streaming tool-call answer gets `finish_reason: tool_calls`,
and a parser-enabled stream gets its logprobs back.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import httpx
import orjson

from ext_proc.config import RenderConfig
from ext_proc.derender.chat import ChatStream
from ext_proc.derender.in_process import derender_whole
from ext_proc.derender.logprobs import chat_logprobs
from ext_proc.derender.model import DerenderModel, fingerprinted
from ext_proc.derender.sidecar_corrections import (
    StopCut,
    cut_fields,
    drop_stop_token,
    prompt_details,
    shown_candidates,
    stop_cuts,
    stop_strings,
    tool_calls_finish_reason,
    without_nulls,
)
from ext_proc.derender.streaming import sse_event
from ext_proc.errors import GatewayError
from ext_proc.frontend.token_only import generate_response
from ext_proc.protocol import Pipeline, TokenizedRequest


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
        + orjson.dumps(request.request.body)
    )


class SidecarDerender:
    """The sidecar as a derender backend (see `ext_proc.derender.Derenderer`)."""

    def __init__(self, client: DerenderClient, model: DerenderModel) -> None:
        self._client = client
        self._model = model  # the gateway's tokenizer and parser class, for the corrections

    def stream(self, request: TokenizedRequest, prompt_index: int = 0) -> SidecarStream:
        return SidecarStream(self._client, request, prompt_index, self._model)

    async def whole(self, request: TokenizedRequest, generate_body: bytes, prompt_index: int = 0) -> bytes:
        """One derender of a whole non-streaming GenerateResponse -> the OpenAI JSON body."""
        prompt = request.prompts[prompt_index]
        request = replace(request, prompts=[prompt])
        trim = shown_candidates(request)
        generate = generate_response(generate_body)
        # usage's reasoning_tokens come from the engine's own ids, before the corrections below
        reasoning = await self._reasoning_details(request, generate)
        if trim is not None:
            trim(generate)
        dropped = drop_stop_token(generate, keep_one=True)  # batch derender rejects empty ids
        if trim is not None or dropped:
            generate_body = orjson.dumps(generate)
        if request.api is Pipeline.CHAT:
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
        result = await self._client.call(request.api.derender_path, body + _static_fields(self._client, request) + b"}")
        result["id"] = request.request_id
        result["model"] = request.request.response_model(self._client.served_name)  # rendered as the base
        if dropped and isinstance(result.get("usage"), dict) and isinstance(generate.get("usage"), dict):
            # the engine's count, with the stop token derender was not shown
            for key in ("completion_tokens", "total_tokens"):
                result["usage"][key] = generate["usage"].get(key, result["usage"].get(key))
        prompt_details(self._model, result.get("usage"), request.api, generate.get("usage"), whole=True)
        if request.api is Pipeline.CHAT:
            tool_calls_finish_reason(result, request.request.body)
            if reasoning is not None and isinstance(result.get("usage"), dict):
                result["usage"]["completion_tokens_details"] = reasoning
        for choice, stop in zip(
            result.get("choices") or [], stop_cuts(request, len(result.get("choices") or [])), strict=False
        ):
            if stop is not None:
                cut_fields(choice.get("message") or choice, stop, final=True)
        self._prompt_logprobs(result, request, generate)
        if (fingerprint := self._model.system_fingerprint()) is not None:  # the engines', not render's
            result["system_fingerprint"] = fingerprint
        return orjson.dumps(result)

    def _prompt_logprobs(self, result: dict[str, Any], request: TokenizedRequest, generate: dict[str, Any]) -> None:
        """`prompt_logprobs` as native shows them (0.32's completions derender drops them),
        decoded by the gateway (under obfuscation the engine's texts are of physical ids)."""
        field = self._model.prompt_logprobs(generate, request.prompts[0])
        if field is None:
            return
        if request.api is Pipeline.CHAT:
            result["prompt_logprobs"] = field
            return
        for choice in result.get("choices") or []:
            choice["prompt_logprobs"] = field

    async def _reasoning_details(self, request: TokenizedRequest, generate: dict[str, Any]) -> Any:
        """Native `completion_tokens_details` of a whole chat answer (one parser pass, on a
        thread), or None when no reasoning parser is configured; `generate` is only read."""
        if request.api is not Pipeline.CHAT or not self._model.include_reasoning_details:
            return None
        native = orjson.loads(await asyncio.to_thread(derender_whole, self._model, request, generate))
        return native["usage"]["completion_tokens_details"]


class SidecarStream:
    """One prompt's events through the sidecar, one `stream_state` per choice. A state
    advances only after derender succeeded for its event."""

    def __init__(
        self, client: DerenderClient, request: TokenizedRequest, prompt_index: int, model: DerenderModel
    ) -> None:
        self._client = client
        self._request = request
        prompt = request.prompts[prompt_index]
        self._index_shift = prompt_index * request.n  # a batch's global choice index, as natively
        self._states: dict[int, Any] = {}
        self._static = (
            b',"prompt_tokens":' + orjson.dumps(len(prompt.token_ids)) + _static_fields(client, request) + b"}"
        )
        self._prompt_ids = b',"prompt_token_ids":' + orjson.dumps(prompt.token_ids)
        # vLLM 0.32's parser path drops stream logprobs; the gateway resolves them itself.
        body = request.request.body
        self._model = model
        self._fix_logprobs = (
            model.logprobs
            if client.prompt_ids_every_call and request.api is Pipeline.CHAT and body.get("logprobs")
            else None
        )
        # usage's reasoning_tokens: counted by replaying the events through a parser once, at the end
        include_usage = self._include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self._fingerprint = model.system_fingerprint()  # the engines', as native stamps the last chunk
        count = request.api is Pipeline.CHAT and include_usage and model.include_reasoning_details
        self._events: list[dict[str, Any]] | None = [] if count else None
        self._stops: dict[int, StopCut] = {}
        self._text_offsets: dict[int, int] = {}
        self._stop_strings = stop_strings(body)
        self._top_logprobs = body.get("top_logprobs")
        self._as_ids = bool(body.get("return_tokens_as_token_ids"))
        self._trim = shown_candidates(request)
        self._logprob_context: dict[int, list[int]] = {}
        self._opened: set[int] = set()  # chat choices whose role chunk went out
        self.completion_tokens = 0

    async def steps(self, events: list[tuple[dict[str, Any], bytes]]) -> bytes:
        """One sidecar call per run of waiting events of one choice (fewer calls under
        backpressure; the sidecar replays chunk by chunk with the merged sizes)."""
        out = bytearray()
        for event, _ in events:
            self.completion_tokens += sum(len(c.get("token_ids") or ()) for c in event.get("choices") or ())
        if self._events is not None:
            self._events.extend(orjson.loads(orjson.dumps(e)) for e, _ in events if e.get("choices"))
        for event, payload in _coalesce(events):
            if self._trim is not None:
                self._trim(event)
                payload = b""
            if drop_stop_token(event):
                payload = b""
            out += await self._step(event, payload or orjson.dumps(event))
        return bytes(out)

    async def _step(self, event: dict[str, Any], payload: bytes) -> bytes:
        choices = event.get("choices") or []
        index = int(choices[0].get("index", 0)) if choices else -1
        result = await self._client.call(self._request.api.derender_path, self._body(payload, index))
        chunk = result.get("chunk")
        if not isinstance(chunk, dict):
            raise GatewayError(502, "derender returned no chunk", code="derender_invalid")
        if index >= 0:
            self._states[index] = result.get("stream_state")
            if self._fix_logprobs is not None:
                self._add_logprobs(chunk, choices[0])
            if self._stop_strings:
                self._cut_stop_strings(chunk, index, choices[0].get("finish_reason") is not None)
            if self._trim is not None and self._request.api is Pipeline.COMPLETIONS:
                self._fix_text_offsets(chunk, index)
        chunk["id"] = self._request.request_id
        chunk["model"] = self._request.request.response_model(self._client.served_name)
        chunk.pop("system_fingerprint", None)  # /derender's null on every chunk: native's is on the last
        for choice in chunk.get("choices") or ():
            choice["index"] = int(choice.get("index", 0)) + self._index_shift
        if not choices:  # the usage chunk: native serializes it without nulls
            chunk = without_nulls(chunk)
            prompt_details(self._model, chunk.get("usage"), self._request.api, event.get("usage"), whole=False)
            if self._events is not None and isinstance(chunk.get("usage"), dict):
                chunk["usage"]["completion_tokens_details"] = {"reasoning_tokens": await self._reasoning_tokens()}
        if self._request.api is Pipeline.CHAT and index >= 0:
            _engine_finish(chunk, choices[0].get("finish_reason"))
        opening = b""
        if self._request.api is Pipeline.CHAT and index >= 0 and index not in self._opened:
            self._opened.add(index)
            opening = sse_event(orjson.dumps(_role_chunk(chunk)))
        if not choices or (choices[0].get("finish_reason") is not None and not self._include_usage):
            chunk = fingerprinted(chunk, self._fingerprint)  # native's last message
        return opening + sse_event(orjson.dumps(chunk))

    async def _reasoning_tokens(self) -> int:
        assert self._events is not None
        events, self._events = self._events, None

        def count() -> int:
            replay = ChatStream(self._model, self._request)
            replay.steps(events)
            return replay.reasoning_tokens()

        return await asyncio.to_thread(count)

    def _fix_text_offsets(self, chunk: dict[str, Any], index: int) -> None:
        """Native streams advance `text_offset` by the tokens reported, not by the text sent
        (text held back for stop strings lags the tokens); vLLM 0.32's derender by the text."""
        for choice in chunk.get("choices") or []:
            logprobs = choice.get("logprobs") or {}
            tokens = logprobs.get("tokens") or []
            offset = self._text_offsets.get(index, 0)
            offsets = []
            for token in tokens:
                offsets.append(offset)
                offset += len(token)
            if tokens:
                logprobs["text_offset"] = offsets
                self._text_offsets[index] = offset

    def _cut_stop_strings(self, chunk: dict[str, Any], index: int, final: bool) -> None:
        stop = self._stops.setdefault(index, StopCut(self._stop_strings))
        for choice in chunk.get("choices") or []:
            cut_fields(choice.get("delta") or choice, stop, final)

    def _add_logprobs(self, chunk: dict[str, Any], choice: dict[str, Any]) -> None:
        assert self._fix_logprobs is not None
        context = self._logprob_context.setdefault(int(choice.get("index", 0)), [])
        positions = self._fix_logprobs.positions(choice.get("logprobs"), context)
        for out in chunk.get("choices") or []:
            if out.get("logprobs") is None and positions:
                out["logprobs"] = chat_logprobs(positions, self._top_logprobs, self._as_ids)

    def _body(self, payload: bytes, index: int) -> bytes:
        body = b'{"stream":true,"generate_chunk":' + payload
        body += b',"stream_state":' + orjson.dumps(self._states.get(index))
        if self._client.prompt_ids_every_call or self._states.get(index) is None:
            body += self._prompt_ids
        return body + self._static


def _engine_finish(chunk: dict[str, Any], engine_finish: Any) -> None:
    """Native streams `tool_calls` for a called tool only when the engine stopped; vLLM 0.32's
    derender also when it ran out of tokens (`length`), which native keeps."""
    for choice in chunk.get("choices") or ():
        if choice.get("finish_reason") == "tool_calls" and engine_finish not in (None, "stop"):
            choice["finish_reason"] = engine_finish


def _role_chunk(chunk: dict[str, Any]) -> dict[str, Any]:
    """A choice's first chunk as native sends it: the role alone (vLLM 0.32's /derender puts
    it on the first token's delta, which a client that skips the role chunk, as vLLM's own
    Messages converter does, would lose). The delta it came on goes on without it."""
    choice = chunk["choices"][0]
    delta = choice.get("delta") or {}
    role = delta.pop("role", None) or "assistant"
    opening = {
        **chunk,
        "choices": [
            {"index": choice["index"], "delta": {"role": role, "content": ""}, "logprobs": None, "finish_reason": None}
        ],
    }
    usage = chunk.get("usage")
    if isinstance(usage, dict):  # continuous usage: nothing generated yet
        prompt = usage.get("prompt_tokens", 0)
        opening["usage"] = {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0}
    return opening


def _coalesce(events: list[tuple[dict[str, Any], bytes]]) -> list[tuple[dict[str, Any], bytes]]:
    """Runs of events of the same choice as one: ids and logprobs concatenated, the last
    event's finish. A merged event has no raw payload (b"")."""
    out: list[tuple[dict[str, Any], bytes]] = []
    for event, payload in events:
        merged = _merge(out[-1][0], event) if out else None
        if merged is None:
            out.append((event, payload))
        else:
            out[-1] = (merged, b"")
    return out


def _merge(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any] | None:
    a, b = first.get("choices"), second.get("choices")
    if not a or not b or len(a) != 1 or len(b) != 1 or first.get("usage") or second.get("usage"):
        return None
    ca, cb = a[0], b[0]
    if ca.get("index", 0) != cb.get("index", 0) or ca.get("finish_reason") is not None:
        return None
    merged = dict(cb)
    merged["token_ids"] = list(ca.get("token_ids") or []) + list(cb.get("token_ids") or [])
    la, lb = ca.get("logprobs"), cb.get("logprobs")
    if la is not None or lb is not None:
        merged["logprobs"] = {"content": list((la or {}).get("content") or []) + list((lb or {}).get("content") or [])}
    return {**second, "choices": [merged]}
