"""End to end through `tito up`: the official openai client against Envoy, a real render
sidecar and a real CPU vLLM engine, compared with that engine's own OpenAI endpoints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai import OpenAI

from tests.conftest import RunningStack, metric, scrape

CJK_EMOJI = "用中文讲个故事 🐉🚀，然后说 こんにちは 👋🏽"
ENGLISH = "Tell me a story about a brave little robot."


def _client(base_url: str) -> OpenAI:
    return OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_tito_up_answered_its_smoke_request(stack: RunningStack) -> None:
    up = [line for line in stack.output if line.startswith("tito is up:")]
    assert up and stack.base_url in up[0]
    smoke = next(line for line in stack.output if line.startswith("smoke request ->"))
    assert orjson.loads(smoke.split("->", 1)[1])["object"] == "chat.completion"


def test_chat_completion(stack: RunningStack) -> None:
    completion = _client(stack.base_url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": ENGLISH}], max_tokens=8, seed=3
    )
    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-") and "generate-tokens" not in completion.id
    assert completion.choices[0].message.role == "assistant"
    assert completion.usage is not None and 1 <= completion.usage.completion_tokens <= 8


def test_chat_stream_is_sse_ending_in_one_done(stack: RunningStack) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": CJK_EMOJI}], "max_tokens": 12, "stream": True}
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json=body, timeout=60, trust_env=False) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw())
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert raw.count(b"[DONE]") == 1
    chunks = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert all(c.get("usage") is None and c["choices"] for c in chunks)  # no include_usage asked, none sent


@dataclass(frozen=True)
class Case:
    api: str
    stream: bool
    prompt: str
    seed: int


CASES = [
    Case("chat", False, ENGLISH, 1),
    Case("chat", True, CJK_EMOJI, 2),
    Case("completions", False, CJK_EMOJI, 3),
    Case("completions", True, ENGLISH, 4),
    Case("chat", True, ENGLISH, 5),
    Case("chat", False, CJK_EMOJI, 6),
    Case("completions", True, CJK_EMOJI, 7),
    Case("completions", False, ENGLISH, 8),
]


def _run(client: OpenAI, case: Case) -> tuple[str, str, str | None, int, int]:
    """(text, reasoning, finish_reason, prompt_tokens, completion_tokens) as a client sees them."""
    common: dict[str, Any] = {"model": "tiny", "max_tokens": 24, "temperature": 1.0, "seed": case.seed}
    if case.stream:
        common |= {"stream": True, "stream_options": {"include_usage": True}}
    if case.api == "chat":
        result = client.chat.completions.create(messages=[{"role": "user", "content": case.prompt}], **common)
    else:
        result = client.completions.create(prompt=case.prompt, **common)
    if not case.stream:
        choice = result.choices[0]
        text = choice.message.content if case.api == "chat" else choice.text
        reasoning = getattr(choice.message, "reasoning", None) if case.api == "chat" else None
        usage = result.usage
        return text or "", reasoning or "", choice.finish_reason, usage.prompt_tokens, usage.completion_tokens
    text, reasoning, finish, usage = "", "", None, None
    for chunk in result:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if case.api == "chat":
                text += choice.delta.content or ""
                reasoning += getattr(choice.delta, "reasoning", None) or ""
            else:
                text += choice.text
            finish = choice.finish_reason or finish
    assert usage is not None
    return text, reasoning, finish, usage.prompt_tokens, usage.completion_tokens


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.api}-{'stream' if c.stream else 'full'}-seed{c.seed}")
def test_gateway_matches_native_vllm(stack: RunningStack, case: Case) -> None:
    gateway = _run(_client(stack.base_url), case)
    native = _run(_client(stack.engine_url), case)
    assert gateway == native
    assert gateway[0] or gateway[1]  # a real, non-empty generation was compared


def test_max_tokens_16_is_kept(stack: RunningStack) -> None:
    """Render omits max_tokens == 16 (msgspec default); the engine must still stop at 16."""
    completion = _client(stack.base_url).completions.create(
        model="tiny", prompt=ENGLISH, max_tokens=16, temperature=1.0, seed=11
    )
    native = _client(stack.engine_url).completions.create(
        model="tiny", prompt=ENGLISH, max_tokens=16, temperature=1.0, seed=11
    )
    assert completion.usage is not None and native.usage is not None
    assert completion.usage.completion_tokens == native.usage.completion_tokens <= 16
    assert completion.choices[0].text == native.choices[0].text


def test_unknown_model_and_models_listing(stack: RunningStack) -> None:
    client = _client(stack.base_url)
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert error.value.status_code == 404
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_the_processor_metrics_after_real_requests(stack: RunningStack) -> None:
    """Prometheus' own parser reads `/metrics`; after real requests the latency histograms
    and the request counters by status have counts, and every answer carries its id."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": ENGLISH}], "max_tokens": 8}
    url = stack.base_url + "/v1/chat/completions"
    answers = [
        httpx.post(url, json={**body, "stream": stream}, timeout=60, trust_env=False) for stream in (False, True)
    ]
    assert [a.status_code for a in answers] == [200, 200]
    assert len({a.headers["x-request-id"] for a in answers}) == 2
    samples = scrape(f"http://127.0.0.1:{stack.config.processor.admin_port}/metrics")
    assert metric(samples, "tito_time_to_first_token_seconds_count", api="chat") >= 2
    assert metric(samples, "tito_render_seconds_count", source="render") >= 2
    assert metric(samples, "tito_derender_chunk_seconds_count") >= 2
    assert metric(samples, "tito_derender_chunk_seconds_sum") > 0
    assert metric(samples, "tito_requests_total", api="chat", status="200") >= 2
    assert metric(samples, "tito_completion_tokens_sum", api="chat") >= 2
