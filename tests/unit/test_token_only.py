from __future__ import annotations

import orjson

from ext_proc.frontend.token_only import generate_body, requested_max_tokens
from ext_proc.protocol import PromptTokens

RENDERED = {
    "request_id": "chatcmpl-1",
    "token_ids": [1, 2, 3],
    "sampling_params": {"temperature": 0.5, "output_kind": 1},
    "output_mode": "tokens",
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": False},
}


def test_max_tokens_16_restored_when_render_omitted_it() -> None:
    prompt = PromptTokens.rendered(RENDERED)
    assert requested_max_tokens(prompt) == 16
    body = orjson.loads(generate_body(prompt, requested_max_tokens(prompt), sampled_beside_k=False))
    assert body["sampling_params"]["max_tokens"] == 16
    assert "max_tokens" not in RENDERED["sampling_params"]  # render output left intact


def test_render_fields_pass_through_with_the_final_max_tokens() -> None:
    rendered = {**RENDERED, "sampling_params": {"max_tokens": 700, "seed": 3}}
    prompt = PromptTokens.rendered(rendered)
    assert requested_max_tokens(prompt) == 700
    body = orjson.loads(generate_body(prompt, 44, sampled_beside_k=False))
    assert body["token_ids"] == [1, 2, 3]
    assert body["sampling_params"] == {"max_tokens": 44, "seed": 3}
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    assert body["output_mode"] == "tokens"
    assert "messages" not in body


def test_completions_logprobs_ask_the_engine_for_one_more_candidate() -> None:
    """Native completions list the sampled token and the top k; generate's list holds k in all."""
    prompt = PromptTokens.rendered({**RENDERED, "sampling_params": {"logprobs": 2}})
    assert orjson.loads(generate_body(prompt, 8, sampled_beside_k=True))["sampling_params"]["logprobs"] == 3
    assert orjson.loads(generate_body(prompt, 8, sampled_beside_k=False))["sampling_params"]["logprobs"] == 2


def test_client_fields_that_steer_engines_never_reach_them() -> None:
    """Render carries them through (priority, cache_salt, kv_transfer_params, vllm_xargs in
    extra_args); the engine body is built from what generate needs only."""
    rendered = {
        **RENDERED,
        "sampling_params": {"max_tokens": 4, "extra_args": {"x": 1, "kv_transfer_params": {"do_remote_prefill": True}}},
        "priority": -5,
        "cache_salt": "salt",
        "kv_transfer_params": {"remote_host": "10.0.0.9"},
        "ec_transfer_params": {"a": 1},
        "token_offsets": [[0, 1]],
        "reasoning_ended": False,
    }
    body = orjson.loads(generate_body(PromptTokens.rendered(rendered), 4, sampled_beside_k=False))
    assert not {"priority", "cache_salt", "kv_transfer_params", "ec_transfer_params", "token_offsets"} & set(body)
    assert body["sampling_params"] == {"max_tokens": 4}
    assert body["reasoning_ended"] is False and body["stream"] is True


def test_a_stream_asks_for_k_tokens_per_event_and_a_whole_answer_never() -> None:
    prompt = PromptTokens.rendered(RENDERED)
    params = orjson.loads(generate_body(prompt, 8, sampled_beside_k=False, stream_interval=4))["sampling_params"]
    assert params["stream_interval"] == 4
    assert "stream_interval" not in orjson.loads(generate_body(prompt, 8, sampled_beside_k=False))["sampling_params"]
    whole = orjson.loads(generate_body(prompt, 8, sampled_beside_k=True, stream=False, stream_interval=4))
    assert whole["stream"] is False and whole["stream_options"] is None
    assert "stream_interval" not in whole["sampling_params"]


def test_stream_interval_auto_rises_with_the_event_loop_lag() -> None:
    from ext_proc.planning.stream_interval import AUTO_MAX, LAG_STEP_MS, stream_interval

    assert stream_interval(3, 100.0) == 3  # a fixed setting is kept whatever the load
    assert (
        stream_interval("auto", 0.0) == stream_interval("auto", LAG_STEP_MS * 0.9) == 1
    )  # keeping up: native's chunking
    assert [stream_interval("auto", LAG_STEP_MS * m) for m in (1, 2, 4, 8)] == [2, 4, 8, 16]
    assert stream_interval("auto", 1e6) == AUTO_MAX
