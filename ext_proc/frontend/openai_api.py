"""The client side: parse and check an OpenAI request once, before anything is called."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import ValidationError

from ext_proc.errors import GatewayError
from ext_proc.frontend.model_catalog import ModelCatalog
from ext_proc.protocol import NOT_FOR_ENGINES, ApiFamily, ApiKind, Conversion, OpenAIRequest

MAX_TOKEN_ID = 1 << 31  # when the vocabulary size is unknown: no tokenizer has more ids


def parse_body(content_type: str | None, raw: bytes) -> dict[str, Any]:
    """The request body as JSON, parsed once (its `model` picks the base model first)."""
    if content_type is not None and "json" not in content_type.lower():
        raise GatewayError(
            400, f"content-type must be application/json, got {content_type!r}", code="invalid_content_type"
        )
    try:
        body: Any = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise GatewayError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise GatewayError(400, "request body must be a JSON object", code="invalid_json")
    return body


def parse_request(
    api: ApiKind,
    body: dict[str, Any],
    catalog: ModelCatalog,
    vocab_size: int | None = None,
    family: ApiFamily = ApiFamily.OPENAI,
    conversion: Conversion | None = None,
) -> OpenAIRequest:
    request = OpenAIRequest(api, body, catalog.resolve(body.get("model")), family, conversion)
    required = {ApiKind.CHAT: "messages", ApiKind.COMPLETIONS: "prompt", ApiKind.RESPONSES: "input"}[api]
    if body.get(required) in (None, [], ""):
        raise GatewayError(
            400, f"'{required}' is a required property", param=required, code="missing_required_parameter"
        )
    if api is ApiKind.COMPLETIONS:
        _check_token_ids(body["prompt"], vocab_size)
    return request


def _check_token_ids(prompt: Any, vocab_size: int | None) -> None:
    """Token-id prompts (`[1, 2]` or `[[1, 2], [3]]`): every id an int in the vocabulary,
    checked before anything is rendered, admitted or sent."""
    if not isinstance(prompt, list):
        return
    for ids in prompt if prompt and isinstance(prompt[0], list) else [prompt]:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            continue  # text prompts, or a shape render will reject with its own message
        limit = vocab_size or MAX_TOKEN_ID
        bad = next((t for t in ids if not 0 <= t < limit), None)
        if bad is not None:
            raise GatewayError(
                400, f"token id {bad} is out of vocabulary [0, {limit})", param="prompt", code="invalid_token_id"
            )


def requested_completion_tokens(request: OpenAIRequest, remaining_context: int) -> int:
    """The completion limit a native engine will apply: the request's, else the rest of the context."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = request.body.get(key)
        if isinstance(value, int) and value > 0:
            return min(value, max(remaining_context, 1))
    return max(remaining_context, 1)


def native_body(request: OpenAIRequest, raw: bytes) -> bytes:
    """The client's body for an engine's own endpoint: as sent, unless it carries fields an
    engine must not get (then re-encoded without them)."""
    if any(key in request.body for key in NOT_FOR_ENGINES):
        return orjson.dumps(request.engine_body())
    return raw


async def validation_error(exc: ValidationError) -> bytes:
    """vLLM's own 400 for a body its request model refuses (FastAPI locates errors in `body`)."""
    from types import SimpleNamespace

    from fastapi.exceptions import RequestValidationError
    from vllm.entrypoints.serve.exception_handling.handlers.validation import validation_exception_handler

    errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)]
    args = SimpleNamespace(log_error_stack=False)
    caller = SimpleNamespace(headers={}, app=SimpleNamespace(state=SimpleNamespace(args=args)), state=SimpleNamespace())
    response = await validation_exception_handler(caller, RequestValidationError(errors))  # type: ignore[arg-type]
    return bytes(response.body)
