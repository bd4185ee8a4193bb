"""The client side: parse and check an OpenAI request once, before anything is called."""

from __future__ import annotations

from typing import Any

import orjson

from ext_proc.config import ModelConfig
from ext_proc.errors import GatewayError
from ext_proc.protocol import ApiKind, OpenAIRequest


def parse_request(api: ApiKind, content_type: str | None, raw: bytes, model: ModelConfig) -> OpenAIRequest:
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
    request = OpenAIRequest(api=api, body=body, raw=raw)
    requested = body.get("model")
    if requested is not None and requested != model.served_name:
        raise GatewayError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")
    required = "messages" if api is ApiKind.CHAT else "prompt"
    if body.get(required) in (None, [], ""):
        raise GatewayError(
            400, f"'{required}' is a required property", param=required, code="missing_required_parameter"
        )
    return request


def is_multi_prompt(request: OpenAIRequest) -> bool:
    """Completions with several prompts: a list of strings or of token-id lists."""
    if request.api is not ApiKind.COMPLETIONS:
        return False
    prompt = request.body.get("prompt")
    return isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(p, int) for p in prompt)


def requested_completion_tokens(request: OpenAIRequest, remaining_context: int) -> int:
    """The completion limit a native engine will apply: the request's, else the rest of the context."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = request.body.get(key)
        if isinstance(value, int) and value > 0:
            return min(value, max(remaining_context, 1))
    return max(remaining_context, 1)
