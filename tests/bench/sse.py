"""The benches' greedy story chats, and the server-sent events of their streams as a client
reads them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

DONE = "[DONE]"


async def events(response: httpx.Response) -> AsyncIterator[dict[str, Any] | str]:
    """Each `data:` event: its JSON, or DONE for `data: [DONE]` (other lines are framing)."""
    async for line in response.aiter_lines():
        if line == "data: [DONE]":
            yield DONE
        elif line.startswith("data: "):
            yield json.loads(line[6:])


def story_chat(i: int, max_tokens: int, prompts: int, stream: bool = True) -> dict[str, Any]:
    """Chat `i` of `prompts` distinct ones: greedy, always `max_tokens` long (ignore_eos)."""
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"Tell story number {i % prompts}."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }
