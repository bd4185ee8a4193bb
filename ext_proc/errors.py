"""OpenAI-compatible errors: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from typing import Any

import orjson

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def error_type(status: int) -> str:
    return _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_payload(
    status: int, message: str, param: str | None = None, code: str | int | None = None, kind: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind or error_type(status), "param": param, "code": code}}


def error_body(
    status: int, message: str, param: str | None = None, code: str | int | None = None, kind: str | None = None
) -> bytes:
    return orjson.dumps(error_payload(status, message, param, code, kind))


class GatewayError(Exception):
    """A request the gateway answers itself with an OpenAI error (or a body passed through)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | int | None = None,
        body: bytes | None = None,
        kind: str | None = None,
        retry_after: int | None = None,
        in_stream: bool = False,
    ) -> None:
        super().__init__(message)
        # a streaming request's error that native's engine finds while generating: the client
        # gets it inside the stream (200, the error event, [DONE]), not as the status
        self.in_stream = in_stream
        self.retry_after = retry_after  # seconds: the Retry-After header of a refusal
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind  # the error's `type` when it is not the status's (native vLLM's own)
        self._body = body

    @property
    def body(self) -> bytes:
        """The upstream's own error body when it was passed through unchanged, else ours."""
        if self._body is not None:
            return self._body
        return error_body(self.status, self.message, self.param, self.code, self.kind)


def _error_field(body: bytes, field: str) -> Any:
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return error.get(field) if isinstance(error, dict) else None


def error_code(body: bytes) -> str | None:
    """The `code` of an OpenAI error body (None when it has none or is not one)."""
    code = _error_field(body, "code")
    return None if code is None else str(code)


def error_message(body: bytes) -> str | None:
    """The `message` of an OpenAI error body (None when it has none or is not one)."""
    message = _error_field(body, "message")
    return message if isinstance(message, str) else None


def normalize_error_body(status: int, body: bytes) -> bytes:
    """An upstream error as an OpenAI error: already-OpenAI JSON passes unchanged."""
    try:
        parsed = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return body
    text = body.decode("utf-8", "replace").strip() or f"upstream returned HTTP {status}"
    return error_body(status, text, code=status)
