"""The one place a TokenizedRequest becomes a token-only `/inference/v1/generate` body."""

from __future__ import annotations

from typing import Any

import orjson

from ext_proc.errors import GatewayError
from ext_proc.protocol import DEFAULT_MAX_TOKENS, PromptTokens

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs: an engine refuses a larger `logprobs` (but -1, all)
GREEDY_BELOW = 1e-5  # vLLM's `_SAMPLING_EPS`: at a lower temperature the engine samples the argmax
# What can make the engine sample another token than the argmax of the raw logprobs it ranks
# the candidates by, even greedily: its logits processors (the bias, allowed and bad words,
# min_tokens' mask of the stop ids, the thinking budget), a grammar, penalties (not neutral).
_ARGMAX_MOVERS = (
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "min_tokens",
    "thinking_token_budget",
    "structured_outputs",
)
_NEUTRAL_PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
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
    sampled_beside_k: bool,
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
    if prefill or stream is False:
        body["stream"], body["stream_options"] = False, None
    if prefill:
        params.pop("min_tokens", None)
        kv_transfer_params = kv_transfer_params or {"do_remote_decode": True, "do_remote_prefill": False}
    if min_tokens is not None:
        params["min_tokens"] = min_tokens
    if "logprobs" in params:
        params["logprobs"] = engine_logprobs(params, sampled_beside_k)
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


def beam_step_body(rendered: dict[str, Any], token_ids: list[int], logprobs: int, temperature: float) -> bytes:
    """One beam-search step (`legs/beam.py`) for one beam: its ids, one token, whole, with
    `logprobs` candidates; of the client's sampling fields only the temperature, as native's
    beam search sends its engine (`BeamSearchOnlineMixin.beam_search`)."""
    body = {key: rendered[key] for key in ("features", "model") if rendered.get(key) is not None}
    body["token_ids"] = token_ids
    body["sampling_params"] = {"max_tokens": 1, "temperature": temperature, "logprobs": logprobs, "detokenize": False}
    body["stream"] = False
    body["output_mode"] = "tokens"
    return orjson.dumps(body)


def engine_logprobs(params: dict[str, Any], sampled_beside_k: bool) -> Any:
    """The candidates per position to ask the engine for: the client's k, as native asks.

    The engine ranks them with `torch.topk(logprobs, k)` (the sampler's `gather_logprobs`),
    whose order among equal logprobs depends on k: asked for another k it shows other tied
    tokens, or the same in another order (common with bf16 logits). Its dict per position is
    the sampled token, then that top k; native chat and Responses show its first k entries,
    as generate does (it cuts its list to max(k, 1) entries).

    `sampled_beside_k`: a completions client, shown the whole dict: k + 1 entries where the
    sampled token ranks outside the top k, and generate would cut the last. Where that can
    happen the engine is asked for k + 1 and derender drops its (k+1)-th candidate
    (`derender/logprobs.py`): none is missing, and what may differ from native is the order
    of tied candidates, where `topk(k + 1)` breaks a tie among its first k otherwise than
    `topk(k)` (the same values; native's own answer when its batch holds a request for k + 1,
    as the sampler ranks a batch at its largest k). Asking for k would instead lose the k-th
    candidate wherever the sampled token ranks outside the top k: under sampling most
    positions of a flat distribution. A greedy token nothing steers is the raw argmax, which
    torch's topk keeps (the first of tied maxima, as argmax; only a vocabulary under 64·k,
    where topk selects otherwise, may drop it when more than k tokens tie at the maximum):
    then k is asked and the answer is native's. k = 0 shows the sampled token alone, which
    generate always keeps."""
    k = params.get("logprobs")
    if not sampled_beside_k or not isinstance(k, int) or not 0 < k < MAX_LOGPROBS or _samples_argmax(params):
        return k
    return k + 1


def _samples_argmax(params: dict[str, Any]) -> bool:
    """Whether the engine's sampled token is the argmax of the raw logprobs it ranks by: a
    greedy request nothing steers off it."""
    temperature = params.get("temperature")
    if temperature is None or float(temperature) >= GREEDY_BELOW or any(params.get(k) for k in _ARGMAX_MOVERS):
        return False
    return all(params.get(key) in (None, neutral) for key, neutral in _NEUTRAL_PENALTIES.items())


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
