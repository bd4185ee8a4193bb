"""Real prefill/decode: `tito up` with one prefill and one decode CPU vLLM engine sharing KV
through vLLM's ExampleConnector (a shared folder), serving chat and completions, streaming
and not, through Handoff. The decode engine's own metric proves it loaded the prompt's KV
from prefill, and at temperature 0 the answer equals the union stack's for the same request.

The same with NixlConnector (the production connector) is opt-in: TITO_TEST_NIXL=1 (needs
`nixl-cu12`; slow on 2 cores, see ../shared/docs/vllm-pd-and-kv-events-on-cpu.md §1)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.conftest import RunningStack, free_port, gateway_config, tito_up

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
            "instances": [{"port": free_port()}],
        }
        for role in ("prefill", "decode")
    ]
    model = {**stack.config.model.model_dump(), "path": stack.model_path}
    config = gateway_config(work / "cache", free_port(), [], stack.model_path, pools=pools, model=model)
    with tito_up(work, config) as running:
        yield running


def _hits(engine_url: str) -> float:
    text = httpx.get(engine_url + "/metrics", timeout=10, trust_env=False).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(HITS))


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
    decode = pd_stack.config.pools[1].instances[0].url
    # a prompt of its own per case: decode must not find it in its local prefix cache
    prompt = f"{api} {stream}: " + "the quick brown fox jumps over the lazy dog, " * 30
    before = _hits(decode)
    text, prompt_tokens = _answer(pd_stack.base_url, api, stream, prompt)
    loaded = _hits(decode) - before
    assert prompt_tokens > BLOCK
    assert loaded == _loaded_by_decode(pd_stack, prompt_tokens), (loaded, prompt_tokens)
    union_text, union_prompt_tokens = _answer(stack.base_url, api, stream, prompt)
    assert (text, prompt_tokens) == (union_text, union_prompt_tokens)
