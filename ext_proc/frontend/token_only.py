"""The one place a TokenizedRequest becomes a token-only `/inference/v1/generate` body."""

from __future__ import annotations

from typing import Any

import orjson

from ext_proc.errors import GatewayError
from ext_proc.protocol import DEFAULT_MAX_TOKENS, ApiKind, PromptTokens

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
# What of render's GenerateRequest an engine gets. Left out: the client-controlled fields
# that steer engines (`priority`, `cache_salt`, `kv_transfer_params` — P/D is the gateway's
# business —, `ec_transfer_params`) and what generate does not use (`token_offsets`).
_GENERATE_FIELDS = (
    "request_id",
    "token_ids",
    "features",
    "content_parts",
    "model",
    "reasoning_ended",
    "reasoning_parser_kwargs",
    "return_token_ids",
    "stream",
    "stream_options",
)


def generate_body(
    prompt: PromptTokens,
    max_tokens: int,
    api: ApiKind,
    *,
    request_id: str | None = None,
    prefill: bool = False,
    kv_transfer_params: dict[str, Any] | None = None,
    min_tokens: int | None = None,
    stream: bool | None = None,
    stream_interval: int = 1,
) -> bytes:
    """The engine body for one prompt and one leg: render's GenerateRequest with the gateway's
    final max_tokens (always explicit: see `requested_max_tokens`).

    `prefill`: a prefill leg (non-streaming, asks the engine to keep the KV for a remote
    decode; no min_tokens unless given: Trigger sets 1). `kv_transfer_params`: the leg's
    (prefill's answer for a Handoff decode leg; Trigger's metaserver or callback params), top
    level and in `extra_args`, where vLLM's connectors look. The gateway owns these fields:
    a client's values never get here. `stream`: whether the engine streams
    (`TokenizedRequest.generate_streams`); None keeps render's. `stream_interval`: tokens
    per engine event (`planning/stream_interval.py`; 1 is the engine's default, not sent)."""
    if prompt.generate_request is None:
        raise ValueError("a token-only request needs render's metadata; locally tokenized prompts go native")
    rendered = prompt.engine_request or prompt.generate_request  # physical ids with obfuscation on
    body = {key: rendered[key] for key in _GENERATE_FIELDS if rendered.get(key) is not None}
    if request_id is not None:
        body["request_id"] = request_id
    # extra_args carries the client's `vllm_xargs` (and a `kv_transfer_params` render moved there)
    params = {k: v for k, v in rendered["sampling_params"].items() if k != "extra_args"}
    params["max_tokens"] = max_tokens
    logprobs = params.get("logprobs")
    if api is ApiKind.COMPLETIONS and isinstance(logprobs, int) and 0 <= logprobs < MAX_LOGPROBS:
        # Completions show the sampled token plus the top k; generate cuts its list to k
        # entries in all, so ask for one more and let derender keep ranks 1..k.
        params["logprobs"] = logprobs + 1
    if prefill or stream is False:
        body["stream"], body["stream_options"] = False, None
    if prefill:
        params.pop("min_tokens", None)
        kv_transfer_params = kv_transfer_params or {"do_remote_decode": True, "do_remote_prefill": False}
    if min_tokens is not None:
        params["min_tokens"] = min_tokens
    if stream_interval > 1 and body.get("stream"):
        params["stream_interval"] = stream_interval
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
        params["extra_args"] = {"kv_transfer_params": kv_transfer_params}
    body["sampling_params"] = params
    # Derender only understands token output; an old engine that ignores this field still
    # answers in tokens, a newer one must not switch modes on us.
    body["output_mode"] = "tokens"
    return orjson.dumps(body)


def requested_max_tokens(prompt: PromptTokens) -> int:
    """max_tokens as render computed it. msgspec omits defaults, so a value of 16 is missing
    from render's output; generate would then re-default it to the whole remaining context."""
    return int(prompt.sampling_params.get("max_tokens", DEFAULT_MAX_TOKENS))


def generate_response(body: bytes) -> dict[str, Any]:
    """A whole (non-streaming) GenerateResponse from an engine, parsed once."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise GatewayError(502, "engine returned invalid JSON", code="engine_invalid_response") from exc
    if not isinstance(parsed, dict):
        raise GatewayError(502, "engine returned no JSON object", code="engine_invalid_response")
    return parsed
