"""Render client: OpenAI request -> token-only GenerateRequest(s), through the render sidecar
(or vLLM's renderer in the processor: `render_in_process.py`, the same outcomes).

Typed outcomes (RFC fault table, "Render Token In" and "Render 请求校验" rows):
- a TokenizedRequest;
- `RenderRejected`: render judged the request itself (400/422, or 404 with an OpenAI error
  body such as an unknown model). The client gets that answer unchanged, no fallback;
- `RenderUnavailable`: timeout, connect error, 5xx, unsupported (404 without an error body,
  405, 415, 501) or an invalid body. The caller falls back to the local tokenizer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

import orjson

from ext_proc.errors import GatewayError, error_body, error_message, normalize_error_body
from ext_proc.frontend.render_http import HttpFailure, RenderHttp
from ext_proc.protocol import OpenAIRequest, Pipeline, PromptTokens, TokenizedRequest

UNSUPPORTED_STATUSES = frozenset({404, 405, 415, 501})
# A prompt that renders to no ids: render's words, and native's for the same prompt (its
# engine's input check: `vllm/v1/engine/input_processor.py`).
EMPTY_PROMPT_RENDER = "No token_ids rendered"
EMPTY_PROMPT_NATIVE = error_body(400, "The decoder prompt cannot be empty", code=400, kind="BadRequestError")
# Beam search: render refuses it; native's completions route refuses a streamed one in its own
# words before it renders (`OpenAIServingCompletion._create_completion`)
BEAM_SEARCH_RENDER = "Beam search is not supported by the render endpoint"
STREAMED_BEAM_SEARCH_NATIVE = error_body(
    400, "Streaming is not currently supported with beam search", code=400, kind="BadRequestError"
)


class RenderRejected(GatewayError):
    """Render's own verdict on the request: passed to the client unchanged."""


class RenderUnavailable(Exception):
    """Render could not tokenize this request for a reason that is not the request's fault."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason  # timeout | unavailable | unsupported | invalid_response


class Renderer(Protocol):
    """Render, wherever it runs: a TokenizedRequest, `RenderRejected` or `RenderUnavailable`."""

    async def render(self, request: OpenAIRequest, raw: bytes, request_id: str) -> TokenizedRequest: ...

    async def answer(self, path: str, raw: bytes, request_id: str) -> tuple[int, bytes]:
        """Render's own status and body on another of its routes (`/tokenize`, ...), as its
        route answers; `RenderUnavailable` when the endpoint cannot be reached."""
        ...

    def close(self) -> None:
        """What it holds open (kept-alive connections) goes."""
        ...


class RenderClient:
    """One render endpoint over HTTP (the pool, `render_pool.py`, balances several)."""

    def __init__(self, url: str, timeout_ms: int, max_connections: int = 256) -> None:
        self._timeout = timeout_ms / 1000
        self._http = RenderHttp(url, max_connections)

    async def render(self, request: OpenAIRequest, raw: bytes, request_id: str) -> TokenizedRequest:
        """`raw`: the client's body as it came (render validates it like vLLM serving)."""
        return rendered(request, *await self.answer(request.endpoint + "/render", raw, request_id))

    async def answer(self, path: str, raw: bytes, request_id: str) -> tuple[int, bytes]:
        try:
            return await self._http.post(path, raw, request_id, self._timeout)
        except TimeoutError as exc:
            raise RenderUnavailable("timeout", repr(exc)) from exc
        except (HttpFailure, OSError) as exc:
            raise RenderUnavailable("unavailable", repr(exc)) from exc

    def close(self) -> None:
        self._http.close()


def rendered(request: OpenAIRequest, status: int, body: bytes) -> TokenizedRequest:
    """Render's answer (status and JSON body, from the sidecar or in-process) as an outcome."""
    if status in (400, 422) or (status == 404 and _is_openai_error(body)):
        body = normalize_error_body(status, body)
        if error_message(body) == EMPTY_PROMPT_RENDER:  # native's engine finds it while generating
            raise RenderRejected(status, "empty prompt", body=EMPTY_PROMPT_NATIVE, in_stream=request.stream)
        if error_message(body) == BEAM_SEARCH_RENDER and request.api is Pipeline.COMPLETIONS and request.stream:
            body = STREAMED_BEAM_SEARCH_NATIVE
        raise RenderRejected(status, "render rejected the request", body=body)
    if status in UNSUPPORTED_STATUSES:
        raise RenderUnavailable("unsupported", f"HTTP {status} on {request.endpoint}/render")
    if status != 200:
        raise RenderUnavailable("unavailable", f"HTTP {status}")
    try:
        parsed: Any = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise RenderUnavailable("invalid_response", "render returned invalid JSON") from exc
    return tokenized(request, parsed)


def beam_search_refused(request: OpenAIRequest, refusal: RenderRejected) -> bool:
    """Render refused a chat or completions request only for its beam search, which the
    gateway runs itself (`legs/beam.py`) on the prompt render gives without it."""
    return request.beam_search and request.conversion is None and error_message(refusal.body) == BEAM_SEARCH_RENDER


def without_beam_search(raw: bytes) -> bytes:
    """The client's body for render without beam search: no `use_beam_search`, and one
    choice (`n` is the beam width, which sampling's own checks must not judge: greedy
    sampling refuses n > 1, native's beam search does not)."""
    body = orjson.loads(raw)
    body.pop("use_beam_search", None)
    body.pop("n", None)
    return orjson.dumps(body)


def beam_searched(tokenized: TokenizedRequest, request: OpenAIRequest) -> TokenizedRequest:
    """Render's prompts of the request without beam search (`without_beam_search`) for the
    client's request: `n` beams, asked of the engine without detokenizing (as native's beam
    search asks: its API server then decodes logprob tokens alone), and the client's body as
    derender reads it (not the model render validated without them)."""
    for i, prompt in enumerate(tokenized.prompts):
        if prompt.generate_request is not None:
            rendered = prompt.generate_request
            params = {**rendered["sampling_params"], "n": request.n, "detokenize": False}
            tokenized.prompts[i] = replace(prompt, generate_request={**rendered, "sampling_params": params})
    tokenized.request = request
    return tokenized


def answered_on(path: str, status: int, body: bytes) -> tuple[int, bytes]:
    """Render's answer on a route other than render (`RenderClient.answer`) as an outcome: its
    own status and body, errors included, passed on unchanged; `RenderUnavailable` when the
    endpoint failed (5xx, 429, no JSON object) or does not serve the route."""
    error = _is_openai_error(body)
    if status in UNSUPPORTED_STATUSES and not error:
        raise RenderUnavailable("unsupported", f"HTTP {status} on {path}")
    if status == 429 or (status >= 500 and not (status == 501 and error)):
        raise RenderUnavailable("unavailable", f"HTTP {status} on {path}")
    if status == 200 and not _is_json_object(body):
        raise RenderUnavailable("invalid_response", f"render answered {path} with no JSON object")
    return status, body


def _is_json_object(body: bytes) -> bool:
    try:
        return isinstance(orjson.loads(body), dict)
    except orjson.JSONDecodeError:
        return False


def _is_openai_error(body: bytes) -> bool:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(parsed, dict) and isinstance(parsed.get("error"), dict)


def tokenized(request: OpenAIRequest, parsed: Any) -> TokenizedRequest:
    """Render's 200 answer (its JSON, parsed) as a TokenizedRequest, or `RenderUnavailable`."""
    generate_requests = parsed if isinstance(parsed, list) else [parsed]
    prompts = []
    for item in generate_requests:
        if not (
            isinstance(item, dict)
            and _token_ids(item.get("token_ids"))
            and isinstance(item.get("sampling_params"), dict)
            and isinstance(item.get("request_id"), str)
        ):
            raise RenderUnavailable("invalid_response", "render returned no valid token_ids/sampling_params")
        prompts.append(PromptTokens.rendered(item))
    if not prompts:
        raise RenderUnavailable("invalid_response", "render returned no prompts")
    return TokenizedRequest(request=request, request_id=_response_id(generate_requests), prompts=prompts)


def _token_ids(ids: Any) -> bool:
    """A non-empty list of non-negative ints (no bools). Checked in C (`map`, `min`): a
    prompt has thousands of ids, and a loop in Python cost 0.3 ms per request."""
    return isinstance(ids, list) and bool(ids) and set(map(type, ids)) == {int} and min(ids) >= 0


def _response_id(generate_requests: list[dict[str, Any]]) -> str:
    """The OpenAI response id. Render names a batch's prompts `<id>-<index>`; native serving
    answers the batch as `<id>`."""
    first: str = generate_requests[0]["request_id"]
    return first.removesuffix("-0") if len(generate_requests) > 1 else first
