"""Processor-owned streams on real CPU vLLM engines, through `tito up` and the official
openai client: a batch of prompts fanned out and merged equals native vLLM's answer to the
same batch, streaming and not; and a stream whose engine is killed mid-answer is relayed to
the other engine, the client's text equal to what one engine says alone (temperature 0)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import RunningStack
from tests.e2e.engine_kill import client, cut_mid_answer, relayed, relays

PROMPTS = ["The capital of France is", "一二三四五", "def fibonacci(n):"]


def _batch(base_url: str, stream: bool, **extra: Any) -> tuple[dict[int, str], tuple[int, int]]:
    """Text per choice index, and (prompt, completion) tokens of the whole batch."""
    common: dict[str, Any] = {
        "model": "tiny",
        "prompt": PROMPTS,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 7,
        "n": 2,
        **extra,
    }
    openai = client(base_url)
    if not stream:
        result = openai.completions.create(**common)
        assert result.usage is not None
        return {c.index: c.text for c in result.choices}, (result.usage.prompt_tokens, result.usage.completion_tokens)
    texts: dict[int, str] = {}
    usage = (0, 0)
    for chunk in openai.completions.create(stream=True, stream_options={"include_usage": True}, **common):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
        if chunk.usage is not None:
            usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
    return texts, usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_batch_through_the_gateway_equals_native_vllm(stack: RunningStack, stream: bool) -> None:
    gateway = _batch(stack.base_url, stream)
    native = _batch(stack.engine_url, stream)
    assert sorted(gateway[0]) == list(range(6))
    assert gateway == native


def test_a_stream_survives_its_engine_dying(two_engines: RunningStack) -> None:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": 1900,  # about 3.5 s of work
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    before = relays(two_engines)  # (the chaos test relayed streams on this stack before)
    killed, reader = cut_mid_answer(two_engines, body)
    assert reader.ended == ["done"]
    assert relayed(two_engines, since=before) == 1
    [survivor] = [i.address for i in two_engines.config.pools[0].instances if i.address != killed]
    native = client("http://" + survivor).completions.create(**body)
    assert "".join(reader.text) == native.choices[0].text
