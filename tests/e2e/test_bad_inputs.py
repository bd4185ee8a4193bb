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
    """The body sent exactly as written (a client library would refuse or fix some of them);
    a stream's answer as its events, each parsed."""
    url = urlsplit(base_url)
    connection = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=60)
    try:
        connection.putrequest("POST", path, skip_accept_encoding=True)
        connection.putheader("content-type", content_type)
        connection.putheader("content-length", str(len(body)))
        connection.endheaders(body or None)
        response = connection.getresponse()
        raw = response.read()
        if (response.getheader("content-type") or "").startswith("text/event-stream"):
            events = [block.removeprefix(b"data: ") for block in raw.split(b"\n\n") if block]
            return response.status, [event if event == b"[DONE]" else orjson.loads(event) for event in events]
        return response.status, orjson.loads(raw)
    finally:
        connection.close()


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_the_edge_refuses_bad_input_as_native_does(stack: RunningStack, route: str, case: str) -> None:
    body, content_type = BAD_INPUTS[case]
    native = _post(stack.engine_url, route, body, content_type)
    assert native[0] == 400  # (the input is bad for every route)
    assert _post(stack.base_url, route, body, content_type) == native


ABSENT = object()  # the field left out
# A route's required input missing or empty, and token ids out of the vocabulary: native's
# request model, its chat template, its renderer and its engine's input check each refuse one
# (the engine's while generating: a stream's error event, after a 200).
EMPTY_INPUTS = {
    "/v1/chat/completions": ("messages", [ABSENT, None, "", []]),
    "/v1/completions": ("prompt", [ABSENT, None, "", [], [[]], [""], [1, 99999999], [[1, 2], [3, 99999999]], [5, -1]]),
    "/v1/responses": ("input", [ABSENT, None, []]),
    "/v1/messages": ("messages", [ABSENT, []]),
    "/v1/messages/count_tokens": ("messages", [[]]),
}


@pytest.mark.parametrize(
    ("route", "value"),
    [(route, value) for route, (_, values) in EMPTY_INPUTS.items() for value in values],
    ids=lambda v: "absent" if v is ABSENT else str(v),
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_empty_or_out_of_range_input_is_refused_as_native_refuses_it(
    stack: RunningStack, route: str, value: Any, stream: bool
) -> None:
    field = EMPTY_INPUTS[route][0]
    body = {"model": "tiny", "max_tokens": 3, "stream": stream} | ({} if value is ABSENT else {field: value})
    raw = orjson.dumps(body)
    native = _post(stack.engine_url, route, raw, JSON)
    assert native[0] == 400 or (stream and native[1][0].get("error")), native
    assert _post(stack.base_url, route, raw, JSON) == native


HI = [{"role": "user", "content": "hi"}]
# Native validates a body with its route's request model before it looks up the model named:
# a body it refuses gets that answer whatever the model; a valid one naming no model served, 404.
BEFORE_THE_MODEL = {
    "chat-no-messages": ("/v1/chat/completions", {"model": "gpt-x", "max_tokens": 3}),
    "chat-model-not-a-string": ("/v1/chat/completions", {"model": 5, "messages": HI}),
    "chat-unknown-model": ("/v1/chat/completions", {"model": "gpt-x", "messages": HI}),
    "completions-no-prompt": ("/v1/completions", {"model": "gpt-x", "max_tokens": 3}),
    "completions-unknown-model-bad-ids": ("/v1/completions", {"model": "gpt-x", "prompt": [99999999]}),
    "messages-no-messages": ("/v1/messages", {"model": "claude-x", "max_tokens": 3}),
    "messages-unknown-model": ("/v1/messages", {"model": "claude-x", "messages": HI, "max_tokens": 3}),
    "responses-bad-tool-choice": ("/v1/responses", {"model": "gpt-x", "input": "hi", "tool_choice": "bogus"}),
    "responses-bad-tool-choice-served-model": ("/v1/responses", {"model": "tiny", "input": "hi", "tool_choice": "x"}),
    "responses-unknown-model": ("/v1/responses", {"model": "gpt-x", "input": "hi", "background": True}),
}


@pytest.mark.parametrize("case", list(BEFORE_THE_MODEL))
def test_a_body_is_validated_before_its_model_is_looked_up(stack: RunningStack, case: str) -> None:
    route, body = BEFORE_THE_MODEL[case]
    raw = orjson.dumps(body)
    native = _post(stack.engine_url, route, raw, JSON)
    assert native[0] in (400, 404)
    assert _post(stack.base_url, route, raw, JSON) == native


@pytest.mark.parametrize("case", ["invalid-json", "empty-messages"])
def test_a_refused_request_keeps_its_connection_as_native_does(stack: RunningStack, case: str) -> None:
    """HTTP/1.1 keep-alive after a 400: the client's next request goes on the same connection."""
    body = BAD_INPUTS["invalid-json"][0] if case == "invalid-json" else b'{"model": "tiny", "messages": []}'
    for base_url in (stack.engine_url, stack.base_url):
        url = urlsplit(base_url)
        connection = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=60)
        try:
            connection.request("POST", "/v1/chat/completions", body, {"content-type": JSON})
            refused = connection.getresponse()
            refused.read()
            socket = connection.sock
            assert (refused.status, refused.getheader("connection"), refused.will_close) == (400, None, False), base_url
            connection.request("GET", "/v1/models")
            listed = connection.getresponse()
            listed.read()
            assert listed.status == 200 and connection.sock is socket, base_url
        finally:
            connection.close()


def test_a_streamed_beam_search_completion_is_refused_as_native_refuses_it(stack: RunningStack) -> None:
    """Native's completions route refuses it before rendering, in its own words (beam search
    itself is served: the conformance cases `beam-search*`)."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "n": 2, "stream": True, "use_beam_search": True}
    raw = orjson.dumps(body)
    native = _post(stack.engine_url, "/v1/completions", raw, JSON)
    assert native[0] == 400 and "beam search" in native[1]["error"]["message"], native
    assert _post(stack.base_url, "/v1/completions", raw, JSON) == native
