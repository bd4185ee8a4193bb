"""`POST /tokenize` and `POST /detokenize` opted into the route table (`listener.routes`) of
a gateway beside the real stack: for the same body, the gateway answers what the stack's
real CPU engine answers on its own routes (status, content type, JSON field by field),
errors included, with render as a sidecar (the stack's) and loaded in process, while its
engine (a simulator) receives nothing. (The default table's 404 for `/tokenize`:
`tests/integration/test_edge.py`.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import RunningStack, SimGateway, leak_checked, running_sim_gateway

OPT_IN = [
    {"method": "POST", "path": "/tokenize", "handler": "tokenize"},
    {"method": "POST", "path": "/detokenize", "handler": "detokenize"},
]
JSON = "application/json"
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in 東京? 🐉"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

# name: (path, body: a JSON body, or raw bytes as sent, content type)
CASES: dict[str, tuple[str, Any, str]] = {
    "completions": ("/tokenize", {"model": "tiny", "prompt": "Hello, world! 你好 🐉"}, JSON),
    "completions-no-special-tokens": (
        "/tokenize",
        {"model": "tiny", "prompt": "Hello", "add_special_tokens": False},
        JSON,
    ),
    "completions-special-tokens": ("/tokenize", {"model": "tiny", "prompt": "Hello", "add_special_tokens": True}, JSON),
    "completions-token-strs": (
        "/tokenize",
        {"model": "tiny", "prompt": "Hello, 世界", "return_token_strs": True},
        JSON,
    ),
    "completions-no-model": ("/tokenize", {"prompt": "no model named"}, JSON),
    "completions-empty-prompt": ("/tokenize", {"model": "tiny", "prompt": ""}, JSON),
    "chat": ("/tokenize", {"model": "tiny", "messages": MESSAGES}, JSON),
    "chat-no-generation-prompt": (
        "/tokenize",
        {"model": "tiny", "messages": MESSAGES, "add_generation_prompt": False},
        JSON,
    ),
    "chat-generation-prompt": (
        "/tokenize",
        {"model": "tiny", "messages": MESSAGES, "add_generation_prompt": True},
        JSON,
    ),
    "chat-special-tokens-strs": (
        "/tokenize",
        {"model": "tiny", "messages": MESSAGES, "add_special_tokens": True, "return_token_strs": True},
        JSON,
    ),
    "chat-continue-final": (
        "/tokenize",
        {
            "model": "tiny",
            "messages": [*MESSAGES, {"role": "assistant", "content": "It is"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
        JSON,
    ),
    "chat-tools-thinking-off": (
        "/tokenize",
        {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}},
        JSON,
    ),
    "detokenize": ("/detokenize", {"model": "tiny", "tokens": [1, 2, 3, 40, 50, 60]}, JSON),
    "detokenize-empty": ("/detokenize", {"model": "tiny", "tokens": []}, JSON),
    # errors
    "error-unknown-model-tokenize": ("/tokenize", {"model": "no-such-model", "prompt": "hi"}, JSON),
    "error-unknown-model-detokenize": ("/detokenize", {"model": "no-such-model", "tokens": [1]}, JSON),
    "error-missing-prompt": ("/tokenize", {"model": "tiny"}, JSON),
    "error-messages-not-a-list": ("/tokenize", {"model": "tiny", "messages": "hi"}, JSON),
    "error-both-prompt-flags": (
        "/tokenize",
        {"model": "tiny", "messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True},
        JSON,
    ),
    "error-client-chat-template": (
        "/tokenize",
        {"model": "tiny", "messages": MESSAGES, "chat_template": "{{ 1 }}"},
        JSON,
    ),
    "error-negative-token-id": ("/detokenize", {"model": "tiny", "tokens": [-1]}, JSON),
    "error-token-id-not-an-int": ("/detokenize", {"model": "tiny", "tokens": ["a", 1.5]}, JSON),
    "error-token-id-out-of-vocabulary": ("/detokenize", {"model": "tiny", "tokens": [1, 1 << 40]}, JSON),
    "error-missing-tokens": ("/detokenize", {"model": "tiny"}, JSON),
    "error-invalid-json": ("/tokenize", b'{"model": "tiny", "prompt": ', JSON),
    "error-not-an-object": ("/detokenize", b"[1, 2]", JSON),
    "error-no-body": ("/tokenize", b"", JSON),
    "error-content-type": ("/tokenize", orjson.dumps({"model": "tiny", "prompt": "hi"}), "text/plain"),
}


@pytest.fixture(scope="module", params=["sidecar", "in_process"])
def opted_in(
    stack: RunningStack, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[SimGateway]:
    """A gateway whose route table opts into both routes, over one engine simulator, render
    as the stack's sidecar or loaded into its processor."""
    routes = [route.model_dump() for route in stack.config.listener.routes] + OPT_IN  # the default table's, and these
    with running_sim_gateway(
        stack,
        tmp_path_factory.mktemp(f"tokenize-{request.param}"),
        1,
        listener={"routes": routes},
        render_config={"mode": request.param},
    ) as gateway:
        yield gateway


@pytest.fixture
def gw(opted_in: SimGateway) -> Iterator[SimGateway]:
    yield from leak_checked(opted_in)


def _post(base_url: str, path: str, body: Any, content_type: str) -> httpx.Response:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return httpx.post(base_url + path, content=raw, headers={"content-type": content_type}, timeout=60, trust_env=False)


@pytest.mark.parametrize("case", list(CASES))
def test_the_gateway_answers_what_the_engine_answers_on_its_own_route(
    gw: SimGateway, stack: RunningStack, case: str
) -> None:
    path, body, content_type = CASES[case]
    native = _post(stack.engine_url, path, body, content_type)
    gateway = _post(gw.base_url, path, body, content_type)
    assert native.status_code != 500, native.text  # a case native itself cannot answer proves nothing
    assert (gateway.status_code, gateway.headers["content-type"]) == (
        native.status_code,
        native.headers["content-type"],
    ), (native.text, gateway.text)
    expected, got = native.json(), gateway.json()
    assert sorted(got) == sorted(expected)
    for field in expected:  # field by field, for a readable failure
        assert got[field] == expected[field], field
    assert [r.path for r in gw.sims[0].received] == []  # no engine ever sees either route


def test_the_cases_cover_both_forms_both_flags_token_strings_and_errors(gw: SimGateway, stack: RunningStack) -> None:
    """The answers differ where the options differ (so equality above is not vacuous)."""

    def tokens(case: str) -> list[int]:
        path, body, content_type = CASES[case]
        answer = _post(gw.base_url, path, body, content_type)
        assert answer.status_code == 200, answer.text
        ids: list[int] = answer.json()["tokens"]
        return ids

    assert tokens("chat-no-generation-prompt") != tokens("chat-generation-prompt")
    assert tokens("chat") == tokens("chat-generation-prompt")  # native's default: a generation prompt
    strs = _post(gw.base_url, *CASES["completions-token-strs"]).json()
    assert len(strs["token_strs"]) == strs["count"] == len(strs["tokens"]) > 0
    assert [r.path for r in gw.sims[0].received] == []
