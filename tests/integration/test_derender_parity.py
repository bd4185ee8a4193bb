"""Parity: in-process and sidecar derender give a client the same answer for the same
generate output. One engine simulator scripts the token ids (the tiny model's tokenizer turns
each case's text into ids); two gateways, one per derender mode, share it and the real render
sidecar. Each case also checks what the in-process answer must contain, so equal answers
cannot hide a case that exercised nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest

from ext_proc.config import Endpoint
from ext_proc.tools.conformance.core import Answer, differences
from ext_proc.tools.conformance.openai import normalize_full, normalize_stream
from ext_proc.tools.conformance.openai_cases import Api
from ext_proc.tools.local_stack import LocalStack
from tests.conftest import RunningStack, start_gateway
from tests.engine_sim import EngineSim, SimServer

EOS = "<|im_end|>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
MULTIBYTE = "🐉🚀こんにちは👋🏽 résumé 鯨龘"


@dataclass(frozen=True)
class Scripted:
    name: str
    api: Api
    text: str  # what the simulated engine generates, as the tiny model tokenizes it
    expect: Callable[[dict[str, Any]], bool]  # on the in-process answer's first choice
    body: dict[str, Any] = field(default_factory=dict)
    finish: str = "stop"  # "stop" without stop_reason: the text ends with the EOS token
    stop_reason: str | None = None


CASES = [
    Scripted(
        "reasoning-content",
        "chat",
        "<think>\nthe robot thinks about 東京\n</think>\n\nhello 世界 🐉🚀" + EOS,
        lambda c: (c["content"] or "").strip() == "hello 世界 🐉🚀" and "東京" in (c["reasoning"] or ""),
    ),
    Scripted(
        "tool-call",
        "chat",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京 🗼"}}\n</tool_call>' + EOS,
        lambda c: (
            [t["arguments"] for t in c["tool_calls"]] == [{"city": "東京 🗼"}] and c["finish_reason"] == "tool_calls"
        ),
        {"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}},
    ),
    Scripted("multibyte", "completions", MULTIBYTE, lambda c: c["text"] == MULTIBYTE, finish="length"),
    Scripted(
        "stop-string",
        "completions",
        "fine, thanks. STOP",
        lambda c: c["text"] == "fine, thanks. " and c["stop_reason"] == "STOP",
        {"stop": ["STOP"]},
        stop_reason="STOP",
    ),
    Scripted(
        "stop-string-chat",
        "chat",
        "fine, thanks. STOP",
        lambda c: (c["content"] or "").endswith("thanks. ") and c["stop_reason"] == "STOP",
        {"stop": ["STOP"], "chat_template_kwargs": {"enable_thinking": False}},
        stop_reason="STOP",
    ),
    Scripted(
        "logprobs-chat",
        "chat",
        "hello world 東京" + EOS,
        lambda c: len(c["logprobs"]) >= 3 and all(len(e["top_logprobs"]) == 2 for e in c["logprobs"]),
        {"logprobs": True, "top_logprobs": 2, "chat_template_kwargs": {"enable_thinking": False}},
    ),
    Scripted(
        "logprobs-completions",
        "completions",
        "hello world 東京",
        lambda c: len(c["logprobs"]["tokens"]) >= 3 and max(len(t) for t in c["logprobs"]["top_logprobs"]) == 3,
        {"logprobs": 2},
        finish="length",
    ),
]


@dataclass
class Pair:
    sim: EngineSim
    gateways: dict[str, str]  # derender mode -> base URL
    tokenizer: Any


@pytest.fixture(scope="module")
def pair(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    from transformers import AutoTokenizer

    server = SimServer(EngineSim()).start()
    started: list[LocalStack] = []
    urls = {}
    try:
        for mode in ("in_process", "sidecar"):
            work = tmp_path_factory.mktemp(f"parity-{mode}")
            config, gateway = start_gateway(stack, work, [Endpoint(port=server.sim.port)], derender={"mode": mode})
            started.append(gateway)
            urls[mode] = f"http://127.0.0.1:{config.listener.port}"
        yield Pair(server.sim, urls, AutoTokenizer.from_pretrained(stack.model_path))
    finally:
        for gateway in started:
            gateway.stop()
        server.stop()


def _answer(base_url: str, case: Scripted, stream: bool) -> Answer:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 200, **case.body}
    if case.api == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    path = "/v1/chat/completions" if case.api == "chat" else "/v1/completions"
    response = httpx.post(base_url + path, json=body, timeout=60, trust_env=False)
    assert response.status_code == 200, response.text
    if stream:
        return normalize_stream(case.api, response.content)
    return normalize_full(case.api, orjson.loads(response.content))


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_in_process_and_sidecar_derender_agree(pair: Pair, case: Scripted, stream: bool) -> None:
    pair.sim.tokens = [int(t) for t in pair.tokenizer.encode(case.text)]
    pair.sim.finish_reason, pair.sim.stop_reason = case.finish, case.stop_reason
    in_process = _answer(pair.gateways["in_process"], case, stream)
    sidecar = _answer(pair.gateways["sidecar"], case, stream)
    assert not in_process.problems and not sidecar.problems, (in_process.problems, sidecar.problems)
    assert case.expect(in_process.choices[0]), in_process.normalized
    assert differences(sidecar.normalized, in_process.normalized) == []
