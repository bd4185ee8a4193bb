"""Real prefill/decode: `tito up` with one prefill and two decode CPU vLLM engines sharing KV
through vLLM's ExampleConnector (a shared folder), relay on, serving chat and completions,
streaming and not, through Handoff (a stream on the processor-owned path, as relay has it).
The decode engines' own metric proves they loaded each prompt's KV from prefill, and at
temperature 0 the answer equals the union stack's for the same request. A batch of prompts
is one Handoff per prompt, merged as the decode engine's native answer to the batch; a
stream whose decode engine is killed mid-answer goes on after a new prefill of the replay
prompt on the other decode engine. Echo and prompt logprobs equal native on this path too.

The same with NixlConnector (the production connector) is opt-in: TITO_TEST_NIXL=1 (needs
`nixl-cu12`; slow on 2 cores, see ../shared/docs/vllm-pd-and-kv-events-on-cpu.md §1)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest
from openai import OpenAI

from ext_proc.tools.conformance.core import MAX_REPORTED, Answer, native_then_gateway, new_client
from ext_proc.tools.conformance.openai import fetch
from ext_proc.tools.conformance.openai_cases import CASES, Case
from tests.conftest import RunningStack, free_port, gateway_config, tito_up
from tests.e2e.engine_kill import client, cut_mid_answer, relayed

BLOCK = 128  # the CPU engines' KV block size
HITS = "vllm:external_prefix_cache_hits_total"


@pytest.fixture(scope="module")
def pd_stack(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    work = tmp_path_factory.mktemp("pdstack")
    connector = "nixl" if os.environ.get("TITO_TEST_NIXL") == "1" else "example"
    pools = [
        {
            "name": role,
            "role": role,
            "kv_connector": connector,
            "block_size": BLOCK,
            "instances": [{"port": free_port()} for _ in range(engines)],
        }
        for role, engines in (("prefill", 1), ("decode", 2))
    ]
    model = {**stack.config.model.model_dump(), "path": stack.model_path}
    config = gateway_config(
        work / "cache", free_port(), [], stack.model_path, pools=pools, model=model, reschedule={"enable": True}
    )
    with tito_up(work, config) as running:
        yield running


def _hits(engine_url: str) -> float:
    text = httpx.get(engine_url + "/metrics", timeout=10, trust_env=False).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(HITS))


def _decode_hits(stack: RunningStack) -> dict[str, float]:
    return {i.address: _hits(i.url) for i in stack.config.pools[1].instances}


def _loaded_by_decode(stack: RunningStack, prompt_tokens: int) -> int:
    """Prompt tokens decode counts as loaded from prefill's KV: NIXL moves the whole prompt;
    ExampleConnector every full block but the one holding the last token (which decode
    recomputes)."""
    if stack.config.pools[1].kv_connector == "nixl":
        return prompt_tokens
    return (prompt_tokens - 1) // BLOCK * BLOCK


def _answer(base_url: str, api: str, stream: bool, prompt: str) -> tuple[str, int]:
    """(the generated text, prompt tokens) through the official client, at temperature 0."""
    client = OpenAI(base_url=base_url + "/v1", api_key="none", http_client=httpx.Client(trust_env=False))
    common: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    if stream:
        common |= {"stream": True, "stream_options": {"include_usage": True}}
    if api == "chat":
        messages = [{"role": "user", "content": prompt}]
        extra = {"chat_template_kwargs": {"enable_thinking": False}}
        result = client.chat.completions.create(messages=messages, extra_body=extra, **common)  # type: ignore[call-overload]
        if not stream:
            message = result.choices[0].message
            return (getattr(message, "reasoning", None) or "") + (message.content or ""), result.usage.prompt_tokens
        text, usage = "", 0
        for chunk in result:
            for choice in chunk.choices:
                text += (getattr(choice.delta, "reasoning", None) or "") + (choice.delta.content or "")
            usage = chunk.usage.prompt_tokens if chunk.usage else usage
        return text, usage
    result = client.completions.create(prompt=prompt, **common)  # type: ignore[call-overload]
    if not stream:
        return result.choices[0].text, result.usage.prompt_tokens
    text, usage = "", 0
    for chunk in result:
        text += "".join(c.text for c in chunk.choices)
        usage = chunk.usage.prompt_tokens if chunk.usage else usage
    return text, usage


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("api", ["chat", "completions"])
def test_handoff_on_real_engines_moves_the_kv_and_matches_union(
    pd_stack: RunningStack, stack: RunningStack, api: str, stream: bool
) -> None:
    # a prompt of its own per case: decode must not find it in its local prefix cache
    prompt = f"{api} {stream}: " + "the quick brown fox jumps over the lazy dog, " * 30
    before = sum(_decode_hits(pd_stack).values())
    text, prompt_tokens = _answer(pd_stack.base_url, api, stream, prompt)
    loaded = sum(_decode_hits(pd_stack).values()) - before
    assert prompt_tokens > BLOCK
    assert loaded == _loaded_by_decode(pd_stack, prompt_tokens), (loaded, prompt_tokens)
    union_text, union_prompt_tokens = _answer(stack.base_url, api, stream, prompt)
    assert (text, prompt_tokens) == (union_text, union_prompt_tokens)


def _batch(base_url: str, prompts: list[str], stream: bool) -> tuple[dict[int, tuple[str, str | None]], Any]:
    """Text and finish reason per choice index, and the usage, at temperature 0."""
    common: dict[str, Any] = {"model": "tiny", "prompt": prompts, "max_tokens": 8, "temperature": 0, "seed": 5}
    client = OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, http_client=httpx.Client(trust_env=False))
    if not stream:
        result = client.completions.create(**common)
        return {c.index: (c.text, c.finish_reason) for c in result.choices}, result.usage
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **common):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            finish[c.index] = c.finish_reason or finish.get(c.index)
        usage = chunk.usage or usage
    return {i: (t, finish[i]) for i, t in texts.items()}, usage


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_a_batch_is_one_handoff_per_prompt_and_equals_native(pd_stack: RunningStack, stream: bool) -> None:
    prompts = [f"batch {stream} {n}: " + "pack my box with five dozen liquor jugs, " * 25 for n in range(3)]
    before = sum(_decode_hits(pd_stack).values())
    gateway, usage = _batch(pd_stack.base_url, prompts, stream)
    loaded = sum(_decode_hits(pd_stack).values()) - before
    per_prompt = usage.prompt_tokens // 3  # the three prompts tokenize to the same length
    assert usage.prompt_tokens == 3 * per_prompt > 3 * BLOCK
    assert loaded == 3 * _loaded_by_decode(pd_stack, per_prompt), (loaded, per_prompt)  # every prompt's KV
    native, native_usage = _batch(pd_stack.config.pools[1].instances[0].url, prompts, stream)
    assert sorted(gateway) == [0, 1, 2] and gateway == native
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        native_usage.prompt_tokens,
        native_usage.completion_tokens,
    )


SCORED_PROMPT_CASES = [c for c in CASES if {"echo", "prompt_logprobs"} & set(c.spec.body)]


@pytest.mark.parametrize("case", SCORED_PROMPT_CASES, ids=lambda case: case.name)
def test_echo_and_prompt_logprobs_through_handoff_equal_native(pd_stack: RunningStack, case: Case) -> None:
    """What evaluation harnesses send, on the processor-owned Handoff path (relay on): the
    decode engine computes the prompt's logprobs itself (vLLM reads no KV for such a request),
    the answer equals its native one but for `system_fingerprint` (decode engines are never
    asked theirs: a probe's request would touch their KV connector's storage)."""
    decode = pd_stack.config.pools[1].instances[0].url
    with new_client() as http:

        def fetched(url: str) -> Answer:
            answer = fetch(http, url, case, pd_stack.config.model.served_name)
            return replace(answer, normalized={k: v for k, v in answer.normalized.items() if k != "system_fingerprint"})

        result = native_then_gateway(case.name, case.spec.expect, fetched, pd_stack.base_url, decode, MAX_REPORTED)
    assert result.status == "PASS", "\n".join(result.lines)


def test_a_stream_whose_decode_engine_dies_is_prefilled_again_and_goes_on(pd_stack: RunningStack) -> None:
    """Runs last: it kills a decode engine."""
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": "Once upon a time, " + "in a land far away, " * 30,  # over a block: the replay's KV moves
        "max_tokens": 1700,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    hits = _decode_hits(pd_stack)
    killed, reader = cut_mid_answer(pd_stack, body)
    assert reader.ended == ["done"]
    assert relayed(pd_stack) == 1
    [survivor] = [i for i in pd_stack.config.pools[1].instances if i.address != killed]
    assert _hits(survivor.url) > hits[survivor.address]  # its KV came from a new prefill leg
    native = client(survivor.url).completions.create(**body)
    assert "".join(reader.text) == native.choices[0].text
