"""`render_config.mode: in_process` against the real render sidecar it replaces: for the same
request body and request id, vLLM's renderer loaded into the processor answers what the
sidecar answers over HTTP, byte for byte, errors included, and the gateway derives the same
outcome (tokenized request, rejection) from both."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from ext_proc.frontend.render import RenderRejected, rendered
from ext_proc.frontend.render_in_process import InProcessRender, request_model
from ext_proc.protocol import OpenAIRequest, Pipeline
from tests.conftest import RunningStack

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CHAT: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in 東京? 🐉"}]}
CASES: dict[str, tuple[Pipeline, Any]] = {
    "chat": (Pipeline.CHAT, {**CHAT, "max_tokens": 8, "stream": True, "seed": 3}),
    "chat-tools-thinking-off": (
        Pipeline.CHAT,
        {**CHAT, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}, "logprobs": True},
    ),
    "chat-structured": (Pipeline.CHAT, {**CHAT, "structured_outputs": {"regex": "[a-z]{3}"}, "n": 2}),
    "chat-no-max-tokens": (Pipeline.CHAT, {**CHAT, "stop": ["."], "temperature": 0}),
    "completions": (Pipeline.COMPLETIONS, {"model": "tiny", "prompt": "Once upon", "max_tokens": 5, "echo": True}),
    "completions-batch": (Pipeline.COMPLETIONS, {"model": "tiny", "prompt": ["one", "two two"], "logprobs": 2}),
    "completions-ids": (Pipeline.COMPLETIONS, {"model": "tiny", "prompt": [5, 6, 7], "min_tokens": 2}),
    "invalid-field": (Pipeline.CHAT, {**CHAT, "temperature": "hot"}),
    "invalid-messages": (Pipeline.CHAT, {"model": "tiny", "messages": "hi"}),
    "unknown-model": (Pipeline.COMPLETIONS, {"model": "nope", "prompt": "x"}),
    "too-long": (Pipeline.COMPLETIONS, {"model": "tiny", "prompt": "hi " * 3000}),
}


@pytest.fixture(scope="module")
def in_process(stack: RunningStack) -> Iterator[InProcessRender]:
    model = stack.config.model.model_copy(update={"path": stack.model_path})
    yield asyncio.run(InProcessRender.load(model))


def _sidecar(stack: RunningStack, api: Pipeline, raw: bytes, request_id: str) -> tuple[int, bytes]:
    response = httpx.post(
        stack.config.render_config.endpoint.url + api.value + "/render",
        content=raw,
        headers={"content-type": "application/json", "x-request-id": request_id},
        timeout=30,
        trust_env=False,
    )
    return response.status_code, response.content


@pytest.mark.parametrize("case", list(CASES))
def test_in_process_render_answers_what_the_sidecar_answers(
    stack: RunningStack, in_process: InProcessRender, case: str
) -> None:
    api, body = CASES[case]
    raw = orjson.dumps(body)
    sidecar = _sidecar(stack, api, raw, "parity-1")
    local = asyncio.run(in_process.answer(api.value + "/render", raw, "parity-1"))
    assert local[0] == sidecar[0]
    assert orjson.loads(local[1]) == orjson.loads(sidecar[1])
    request = OpenAIRequest(api, body)
    if sidecar[0] == 200:
        tokenized = asyncio.run(in_process.render(request, raw, "parity-1"))
        assert tokenized == rendered(request, *sidecar)
        # vLLM's model of the request, as derender would validate it: read, not made again
        assert type(tokenized.request.validated) is request_model(api)
    else:
        with pytest.raises(RenderRejected) as err:
            asyncio.run(in_process.render(request, raw, "parity-1"))
        assert err.value.status == sidecar[0]


@pytest.mark.parametrize("extra", [{"metadata": {"k": "v"}}, {"user": "u1"}, {"model": "tiny-alias"}])
def test_a_body_derender_keeps_otherwise_is_validated_again(in_process: InProcessRender, extra: dict[str, Any]) -> None:
    """Derender keeps the body without `metadata` and `user`, and render gets it under the
    base model's name: for such a body render's validated request is not derender's."""
    api, body = CASES["chat"]
    request = OpenAIRequest(api, {**body, **extra})
    raw = orjson.dumps({**body, **{k: v for k, v in extra.items() if k != "model"}})
    assert asyncio.run(in_process.render(request, raw, "parity-2")).request.validated is None
