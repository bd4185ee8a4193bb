"""A client's body as vLLM's HTTP server reads it before any route runs, with native's own
rejections: FastAPI parses the JSON (`fastapi/routing.py`), then every route's
`validate_json_request` wants `application/json`, then the route's request model wants an
object. These answers are the same for every API vLLM serves (its validation handler, or
FastAPI's own `{"detail": ...}`), so they are made here once."""

from __future__ import annotations

import email.message
import json
from types import SimpleNamespace
from typing import Any

import orjson
from pydantic import ValidationError

from ext_proc.errors import GatewayError
from ext_proc.frontend.render_in_process import as_fastapi_validates
from ext_proc.planning.plan import Local

UNSUPPORTED_MEDIA = "Unsupported Media Type: Only 'application/json' is allowed"
UNPARSABLE = b'{"detail":"There was an error parsing the body"}'  # FastAPI's HTTPException(400)


async def parse_body(content_type: str | None, raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, parsed once; a GatewayError with native's status and
    body for what native refuses before its route."""
    body = (await _json(raw) if _json_content(content_type) else raw) if raw else None
    media = (content_type or "").lower().split(";", maxsplit=1)[0]
    if media != "application/json":
        raise await _invalid([UNSUPPORTED_MEDIA], "content-type must be application/json")
    if body is None:
        missing = {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}
        raise await _invalid([missing], "the request has no body")
    if not isinstance(body, dict):
        message = "Input should be a valid dictionary or object to extract fields from"
        error = {"type": "model_attributes_type", "loc": ("body",), "msg": message, "input": body}
        raise await _invalid([error], "the request body is not a JSON object")
    return body


def _json_content(content_type: str | None) -> bool:
    """Whether FastAPI parses the body as JSON (strict: a content type must say so)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


async def _json(raw: bytes) -> Any:
    """orjson on the hot path; what it refuses is parsed again as FastAPI parses it (Python's
    json), for native's answer: the same decode error and position, or what Python accepts."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        error = {"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error", "input": {}}
        raise await _invalid([{**error, "ctx": {"error": exc.msg}}], f"request body is not valid JSON: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - undecodable bytes, nesting too deep: FastAPI's 400
        raise GatewayError(400, "there was an error parsing the body", body=UNPARSABLE) from exc


async def refused_by(model: Any, raw: bytes) -> Local | None:
    """Native's answer when its request `model` refuses the body (None: it takes it). FastAPI
    validates the parsed JSON before the route runs, so before the route looks up its model;
    a model's own validator may raise vLLM's client error, which native's handlers answer."""
    from vllm.exceptions import VLLMClientError

    try:
        as_fastapi_validates(model, orjson.loads(raw))
    except ValidationError as exc:
        return Local(400, await validation_error(exc))
    except VLLMClientError as exc:
        return await handled_exception(exc)
    return None


async def validation_error(exc: ValidationError) -> bytes:
    """vLLM's own 400 for a body its request model refuses (FastAPI locates errors in `body`)."""
    errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)]
    return await _handled(errors)


async def _invalid(errors: list[Any], message: str) -> GatewayError:
    return GatewayError(400, message, body=await _handled(errors))


async def _handled(errors: list[Any]) -> bytes:
    """What vLLM's validation handler answers for these errors."""
    from fastapi.exceptions import RequestValidationError
    from vllm.entrypoints.serve.exception_handling.handlers.validation import validation_exception_handler

    response = await validation_exception_handler(_caller(), RequestValidationError(errors))  # type: ignore[arg-type]
    return bytes(response.body)


async def handled_exception(exc: Exception) -> Local:
    """What vLLM's exception handler answers for an exception of the route."""
    from vllm.entrypoints.serve.exception_handling.handlers.exception import exception_handler

    response = await exception_handler(_caller(), exc)  # type: ignore[arg-type]
    return Local(response.status_code, bytes(response.body))


def _caller() -> Any:
    """What vLLM's handlers read of the HTTP request: the server's args."""
    args = SimpleNamespace(log_error_stack=False)
    return SimpleNamespace(headers={}, app=SimpleNamespace(state=SimpleNamespace(args=args)), state=SimpleNamespace())
