"""`system_fingerprint`: the gateway's answers carry the engine's own, where native puts it.

vLLM stamps its version and config hash on a whole answer, and in a stream on each choice's
last chunk, or on the usage chunk alone when usage is included. The gateway learns the value
from its capability probe of the engine (nothing else the engine serves shows it). Each case
goes to the stack's own engine (native) and through the gateway in front of it."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import RunningStack

pytestmark = pytest.mark.real

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
INPUTS: dict[str, dict[str, Any]] = {
    "chat": {"messages": [{"role": "user", "content": "Say something."}]},
    "completions": {"prompt": ["Once upon", "a time"]},  # a batch: each prompt's last chunk
}
STREAMS = {
    "whole": None,
    "stream": {},
    "stream-usage": {"stream_options": {"include_usage": True}},
    "stream-continuous-usage": {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
}


def _stamps(raw: bytes, streamed: bool) -> list[tuple[str, Any]]:
    """Where the answer carries a fingerprint and which: the whole answer's field, or each
    stamped chunk's kind (a choice's last chunk, the usage chunk, any other)."""
    if not streamed:
        return [("whole", orjson.loads(raw)["system_fingerprint"])]
    stamps = []
    for line in raw.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        chunk = orjson.loads(line[len(b"data: ") :])
        if "system_fingerprint" in chunk:
            choices = chunk.get("choices") or []
            kind = "usage" if not choices else "last" if choices[0].get("finish_reason") else "other"
            stamps.append((kind, chunk["system_fingerprint"]))
    return stamps


@pytest.mark.parametrize("streaming", list(STREAMS))
@pytest.mark.parametrize("api", list(PATHS))
def test_answers_carry_the_engines_fingerprint_where_native_does(stack: RunningStack, api: str, streaming: str) -> None:
    options = STREAMS[streaming]
    body = {"model": "tiny", "max_tokens": 4, "seed": 7, **INPUTS[api]}
    if options is not None:
        body |= {"stream": True, **options}
    answers = []
    for base in (stack.engine_url, stack.base_url):
        response = httpx.post(base + PATHS[api], json=body, timeout=120)
        assert response.status_code == 200, response.text
        answers.append(_stamps(response.content, options is not None))
    native, gateway = answers
    assert native and all(isinstance(value, str) and value.startswith("vllm-") for _, value in native)
    assert gateway == native
