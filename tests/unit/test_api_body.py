"""The edge's refusals before any route (`ext_proc/api/body.py`), as vLLM 0.32 answered them
on `/v1/chat/completions` (measured; tests/e2e/test_bad_inputs.py compares with a live engine
on every rendered API's route)."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import orjson
import pytest

from ext_proc.api.body import parse_body
from ext_proc.errors import GatewayError

JSON = "application/json"


def _validation(message: str, param: str | None) -> dict[str, Any]:
    return {
        "error": {"message": "1 validation error:\n  " + message, "type": "Bad Request", "param": param, "code": 400}
    }


NATIVE = {
    "invalid-json": (
        b'{"model": "tiny", "messages": [',
        JSON,
        _validation(
            "{'type': 'json_invalid', 'loc': 'body.31', 'msg': 'JSON decode error', 'input': '<dict of 0 items>',"
            " 'ctx': {'error': 'Expecting value'}}",
            "body.31",
        ),
    ),
    "invalid-utf8": (b'{"prompt": "\xff\xfe"}', JSON, {"detail": "There was an error parsing the body"}),
    "nested-5000-deep": (b"[" * 5000 + b"]" * 5000, JSON, {"detail": "There was an error parsing the body"}),
    "text-plain": (
        b'{"prompt": "hi"}',
        "text/plain",
        _validation("Unsupported Media Type: Only 'application/json' is allowed", None),
    ),
    "no-content-type": (
        b'{"prompt": "hi"}',
        None,
        _validation("Unsupported Media Type: Only 'application/json' is allowed", None),
    ),
    "empty-body": (
        b"",
        JSON,
        _validation("{'type': 'missing', 'loc': 'body', 'msg': 'Field required', 'input': 'None'}", "body"),
    ),
    "array-body": (
        b'[{"model": "tiny"}, 2]',
        JSON,
        _validation(
            "{'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid dictionary or object"
            " to extract fields from', 'input': '<list of 2 items>'}",
            "body",
        ),
    ),
}


@pytest.mark.parametrize("case", list(NATIVE))
def test_bad_bodies_get_natives_status_and_body(case: str) -> None:
    raw, content_type, native = NATIVE[case]
    with pytest.raises(GatewayError) as refused:
        asyncio.run(parse_body(content_type, raw))
    assert refused.value.status == 400 and orjson.loads(refused.value.body) == native


@pytest.mark.parametrize("content_type", [JSON, "application/json; charset=utf-8", "APPLICATION/JSON"])
def test_a_json_object_is_parsed_once(content_type: str) -> None:
    assert asyncio.run(parse_body(content_type, b'{"model": "tiny"}')) == {"model": "tiny"}


def test_what_python_json_accepts_and_orjson_refuses_is_accepted_as_natively() -> None:
    assert math.isnan(asyncio.run(parse_body(JSON, b'{"temperature": NaN}'))["temperature"])  # as FastAPI parses it
