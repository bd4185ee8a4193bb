"""The one place a TokenizedRequest becomes a token-only `/inference/v1/generate` body."""

from __future__ import annotations

import orjson

from ext_proc.protocol import DEFAULT_MAX_TOKENS, PromptTokens


def generate_body(prompt: PromptTokens) -> bytes:
    """The engine body for one prompt: render's GenerateRequest, with vLLM's pitfalls fixed."""
    body = dict(prompt.generate_request)
    params = dict(prompt.sampling_params)
    # msgspec omits defaults, so a requested max_tokens of 16 vanished from render's output;
    # generate would then re-default it to the whole remaining context.
    params.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    body["sampling_params"] = params
    # Derender only understands token output; an old engine that ignores this field still
    # answers in tokens, a newer one must not switch modes on us.
    body["output_mode"] = "tokens"
    return orjson.dumps(body)


def max_tokens(prompt: PromptTokens) -> int:
    value = prompt.sampling_params.get("max_tokens", DEFAULT_MAX_TOKENS)
    return int(value)
