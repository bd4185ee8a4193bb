"""The one place a TokenizedRequest becomes a token-only `/inference/v1/generate` body."""

from __future__ import annotations

import orjson

from ext_proc.protocol import DEFAULT_MAX_TOKENS, PromptTokens


def generate_body(prompt: PromptTokens, max_tokens: int) -> bytes:
    """The engine body for one prompt: render's GenerateRequest with the gateway's final
    max_tokens (always explicit: see `requested_max_tokens`)."""
    if prompt.generate_request is None:
        raise ValueError("a token-only request needs render's metadata; locally tokenized prompts go native")
    body = dict(prompt.generate_request)
    body["sampling_params"] = {**prompt.sampling_params, "max_tokens": max_tokens}
    # Derender only understands token output; an old engine that ignores this field still
    # answers in tokens, a newer one must not switch modes on us.
    body["output_mode"] = "tokens"
    return orjson.dumps(body)


def requested_max_tokens(prompt: PromptTokens) -> int:
    """max_tokens as render computed it. msgspec omits defaults, so a value of 16 is missing
    from render's output; generate would then re-default it to the whole remaining context."""
    return int(prompt.sampling_params.get("max_tokens", DEFAULT_MAX_TOKENS))
