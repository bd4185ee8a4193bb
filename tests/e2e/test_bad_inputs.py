"""What the edge refuses before any route, answered as native vLLM answers it: the same status
and the same body, byte for byte parsed, for each rendered API's route. Each bad input goes to
the stack's own engine (native) and through the gateway in front of it."""

from __future__ import annotations

import http.client
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest

from tests.conftest import RunningStack

pytestmark = pytest.mark.real

JSON = "application/json"
BAD_INPUTS = {
    "invalid-json": (b'{"model": "tiny", "messages": [', JSON),
    "invalid-utf8": (b'{"model": "tiny", "prompt": "\xff\xfe"}', JSON),
    "nested-5000-deep": (b"[" * 5000 + b"]" * 5000, JSON),
    "text-plain": (b'{"model": "tiny", "prompt": "hi"}', "text/plain"),
    "empty-body": (b"", JSON),
    "array-body": (b'[{"model": "tiny"}, 2]', JSON),
}
ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]


def _post(base_url: str, path: str, body: bytes, content_type: str) -> tuple[int, Any]:
    """The body sent exactly as written (a client library would refuse or fix some of them)."""
    url = urlsplit(base_url)
    connection = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=60)
    try:
        connection.putrequest("POST", path, skip_accept_encoding=True)
        connection.putheader("content-type", content_type)
        connection.putheader("content-length", str(len(body)))
        connection.endheaders(body or None)
        response = connection.getresponse()
        return response.status, orjson.loads(response.read())
    finally:
        connection.close()


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_the_edge_refuses_bad_input_as_native_does(stack: RunningStack, route: str, case: str) -> None:
    body, content_type = BAD_INPUTS[case]
    native = _post(stack.engine_url, route, body, content_type)
    assert native[0] == 400  # (the input is bad for every route)
    assert _post(stack.base_url, route, body, content_type) == native
