"""In-process derender on scripted generate output, with the tiny model's real tokenizer and
vLLM's qwen3/hermes parsers: what a client sees, chunk by chunk."""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace
from typing import Any

import orjson
import pytest

from ext_proc.errors import GatewayError
from ext_proc.protocol import OpenAIRequest, Pipeline, PromptTokens, TokenizedRequest

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
EOS = "<|im_end|>"


@pytest.fixture
def model(derender_model: Any) -> Any:
    return derender_model


def _request(model: Any, api: Pipeline, body: dict[str, Any], params: dict[str, Any] | None = None) -> TokenizedRequest:
    body = {"model": "tiny", **body}
    prompt_ids = [int(t) for t in model.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")]
    rendered = {"token_ids": prompt_ids, "sampling_params": params or {}, "request_id": "chatcmpl-t"}
    return TokenizedRequest(OpenAIRequest(api, body), "chatcmpl-t", [PromptTokens.rendered(rendered)])


def _ids(model: Any, text: str) -> list[int]:
    return [int(t) for t in model.tokenizer.encode(text)]


def _events(ids: list[int], finish: str = "stop", stop_reason: Any = None) -> list[dict[str, Any]]:
    last = len(ids) - 1
    return [
        {
            "choices": [
                {
                    "index": 0,
                    "token_ids": [t],
                    "finish_reason": finish if i == last else None,
                    "stop_reason": stop_reason if i == last else None,
                }
            ]
        }
        for i, t in enumerate(ids)
    ]


def _stream(model: Any, request: TokenizedRequest, events: list[dict[str, Any]], together: bool = False) -> list[Any]:
    from ext_proc.derender.in_process import stream_session

    session = stream_session(model, request)
    raw = session.steps(events) if together else b"".join(session.steps([e]) for e in events)
    return [orjson.loads(e.removeprefix(b"data: ")) for e in raw.split(b"\n\n") if e]


def _joined(chunks: list[Any], key: str) -> str:
    return "".join((c["choices"][0].get("delta") or {}).get(key) or "" for c in chunks if c["choices"])


def test_reasoning_content_and_eos_split_like_native(model: Any) -> None:
    """The qwen3 parser sees only new ids; the EOS that ended generation is never shown."""
    request = _request(
        model,
        Pipeline.CHAT,
        {"messages": [{"role": "user", "content": "hi"}], "stream": True},
        {"skip_special_tokens": False},
    )
    ids = _ids(model, "<think>\nthe robot thinks 東京\n</think>\n\nhello 世界 🐉🚀" + EOS)
    chunks = _stream(model, request, _events(ids))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert _joined(chunks, "reasoning").strip() == "the robot thinks 東京"
    assert _joined(chunks, "content").strip() == "hello 世界 🐉🚀"
    assert all("\ufffd" not in (c["choices"][0]["delta"].get("content") or "") for c in chunks[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_streamed_tool_call_ends_with_finish_reason_tool_calls(model: Any) -> None:
    body = {
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": TOOLS,
        "stream": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    request = _request(model, Pipeline.CHAT, body, {"skip_special_tokens": False})
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京 🗼"}}\n</tool_call>'
    chunks = _stream(model, request, _events(_ids(model, call + EOS)))
    calls = [tc for c in chunks[1:] for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"]
    assert orjson.loads("".join(tc["function"].get("arguments") or "" for tc in calls)) == {"city": "東京 🗼"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_stop_string_is_held_back_then_cut(model: Any) -> None:
    """The engine stops on the token completing the stop string; no chunk ever shows it."""
    request = _request(model, Pipeline.COMPLETIONS, {"prompt": "hi", "stream": True}, {"stop": ["STOP here"]})
    ids = _ids(model, "hello world STOP here")
    chunks = _stream(model, request, _events(ids, "stop", "STOP here"))
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == "hello world "
    assert not any("STOP" in t for t in texts)
    assert chunks[-1]["choices"][0]["stop_reason"] == "STOP here"


def test_text_waiting_together_is_one_chunk_and_equal_text(model: Any) -> None:
    """Backpressure: events that arrived together become fewer chunks, same text."""
    request = _request(model, Pipeline.COMPLETIONS, {"prompt": "hi", "stream": True})
    events = _events(_ids(model, "one two three 🐉 four five"), "length")
    apart, together = _stream(model, request, events), _stream(model, request, events, together=True)
    text = "".join(c["choices"][0]["text"] for c in apart)
    assert "".join(c["choices"][0]["text"] for c in together) == text == "one two three 🐉 four five"
    assert len(together) == 2 < len(apart)  # the text, then the finish chunk on its own
    assert together[-1]["choices"][0]["finish_reason"] == "length"


def test_whole_response_equals_the_stream(model: Any) -> None:
    from ext_proc.derender.in_process import derender_whole

    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}
    request = _request(model, Pipeline.CHAT, body, {"skip_special_tokens": False})
    ids = _ids(
        model,
        "<think>\nhmm\n</think>\n\n" + '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>' + EOS,
    )
    generate = {"choices": [{"index": 0, "token_ids": ids, "finish_reason": "stop", "stop_reason": None}]}
    response = orjson.loads(derender_whole(model, request, generate))
    choice = response["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning"].strip() == "hmm"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": "{}"}
    assert response["usage"]["completion_tokens"] == len(ids)


def _scored_prompt(ids: list[int]) -> list[Any]:
    """Prompt logprobs as a whole generate answer carries them: the first position None, then
    the prompt's id first with its rank, then the top candidate."""
    return [None] + [
        {str(t): {"logprob": -1.5 - i, "rank": 7}, "0": {"logprob": -0.5, "rank": 1}} for i, t in enumerate(ids[1:])
    ]


def _echo_request(model: Any, prompt: str, body: dict[str, Any]) -> TokenizedRequest:
    rendered = {"token_ids": _ids(model, prompt), "sampling_params": {}, "request_id": "cmpl-t"}
    return TokenizedRequest(
        OpenAIRequest(Pipeline.COMPLETIONS, {"model": "tiny", "prompt": prompt, **body}),
        "cmpl-t",
        [PromptTokens.rendered(rendered)],
    )


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_shows_the_prompt_and_its_logprobs_stream_and_whole_alike(model: Any, max_tokens: int) -> None:
    """lm-eval's loglikelihood request: the prompt's text and logprobs (first null, offsets over
    the decoded tokens), then the output unless `max_tokens: 0` (the engine's one token hidden)."""
    from ext_proc.derender.in_process import derender_whole, stream_session
    from ext_proc.derender.pipeline import whole_events

    prompt = "Hello 東京 world"
    request = _echo_request(model, prompt, {"echo": True, "logprobs": 1, "max_tokens": max_tokens, "stream": True})
    prompt_ids, output = request.prompts[0].token_ids, _ids(model, " yes no")[: max(max_tokens, 1)]
    top = [{"token_id": t, "logprob": -0.25, "rank": 1, "top_logprobs": []} for t in output]
    generate = {
        "prompt_logprobs": _scored_prompt(prompt_ids),
        "choices": [{"index": 0, "token_ids": output, "finish_reason": "length", "logprobs": {"content": top}}],
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(output), "total_tokens": 0},
    }
    raw = stream_session(model, request).steps(whole_events(generate))
    (chunk,) = [orjson.loads(e.removeprefix(b"data: ")) for e in raw.split(b"\n\n") if e]
    streamed = chunk["choices"][0]
    whole = orjson.loads(derender_whole(model, request, generate))["choices"][0]
    shown = prompt_ids + (output if max_tokens else [])
    assert streamed["text"] == whole["text"] == prompt + (model.tokenizer.decode(output) if max_tokens else "")
    assert streamed["logprobs"] == whole["logprobs"]
    logprobs = whole["logprobs"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == [-1.5 - i for i in range(len(prompt_ids) - 1)] + [-0.25] * (
        len(shown) - len(prompt_ids)
    )
    # offsets run over the tokens' own texts (a split character is U+FFFD in each), not the text
    assert logprobs["text_offset"] == [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(shown))]
    assert streamed["prompt_token_ids"] == prompt_ids  # native's echo chunk carries them
    assert whole["prompt_logprobs"][0] is None and whole["prompt_logprobs"][1][str(prompt_ids[1])]["rank"] == 7


def test_echo_without_logprobs_decodes_a_token_prompt(model: Any) -> None:
    from ext_proc.derender.in_process import derender_whole

    ids = _ids(model, "Hello world")
    rendered = {"token_ids": ids, "sampling_params": {}, "request_id": "cmpl-t"}
    body = {"model": "tiny", "prompt": ids, "echo": True, "max_tokens": 2}
    request = TokenizedRequest(OpenAIRequest(Pipeline.COMPLETIONS, body), "cmpl-t", [PromptTokens.rendered(rendered)])
    generate = {"choices": [{"index": 0, "token_ids": _ids(model, "!!"), "finish_reason": "length"}]}
    whole = orjson.loads(derender_whole(model, request, generate))["choices"][0]
    assert whole["text"] == "Hello world!!" and whole["logprobs"] is None and whole["prompt_logprobs"] is None


def test_chat_echo_repeats_the_continued_message_before_the_output(model: Any) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "echo": True,
        "logprobs": True,
        "stream": True,
    }
    request = _request(model, Pipeline.CHAT, body, {"skip_special_tokens": False})
    ids = _ids(model, " a time")
    top = {"content": [{"token_id": ids[0], "logprob": -0.1, "rank": 1, "top_logprobs": []}]}
    events = [{"choices": [{"index": 0, "token_ids": ids[:1], "logprobs": top}]}]
    chunks = _stream(model, request, events, together=True)
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [
        {"role": "assistant", "content": ""},
        {"content": "Once upon"},
    ]
    assert chunks[2]["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.1  # not merged into the echo


def test_prompt_cache_counts_are_native_usage_details(model: Any) -> None:
    """Generate reports the cached tokens; chat adds the prompt's full blocks (128 tokens)
    the prefill wrote beyond them, as the engine counts them."""
    assert model.prompt_details(True, 300, 0, whole=True) == {
        "cached_tokens": 0,
        "created_cache_tokens": 256,
        "multimodal_tokens": None,
    }
    assert model.prompt_details(True, 300, 256, whole=False) == {"cached_tokens": 256, "created_cache_tokens": 0}
    assert model.prompt_details(False, 300, 128, whole=False) == {"cached_tokens": 128}
    assert model.prompt_details(True, 100, 0, whole=False) == {"cached_tokens": 0, "created_cache_tokens": 0}


def test_the_engines_cached_tokens_reach_the_final_usage_chunk(model: Any) -> None:
    body = {"messages": [], "stream": True, "stream_options": {"include_usage": True}}
    usage = {
        "prompt_tokens": 9,
        "total_tokens": 10,
        "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    chunks = _stream(model, _request(model, Pipeline.CHAT, body), [*_events(_ids(model, "hi")), {"usage": usage}])
    final = chunks[-1]["usage"]
    assert list(final) == [
        "prompt_tokens",
        "total_tokens",
        "completion_tokens",
        "prompt_tokens_details",
        "completion_tokens_details",
    ]
    assert final["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": 0}


@pytest.mark.parametrize("limit", [1 << 20, 0])  # the session made on the loop, then on a thread
def test_a_session_made_on_the_loop_or_on_a_thread_streams_the_same(
    model: Any, limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short prompt's stream session is made on the loop, a long one's on a thread
    (`SESSION_ON_LOOP_MAX_TOKENS`): the client sees the same chunks either way, and a session
    that cannot be made fails the stream at its first event."""
    from ext_proc.derender import pipeline
    from ext_proc.derender.in_process import stream_session

    monkeypatch.setattr(pipeline, "SESSION_ON_LOOP_MAX_TOKENS", limit)
    request = _request(model, Pipeline.CHAT, {"messages": [{"role": "user", "content": "hi"}], "stream": True})
    ids = _ids(model, "<think>\nhm\n</think>\n\nHello there" + EOS)
    session = stream_session(model, request)
    expected = b"".join(session.steps([e]) for e in _events(ids))

    async def streamed() -> bytes:
        stream = pipeline.InProcessDerender(model).stream(request)
        return b"".join([await stream.steps([(e, b"")]) for e in _events(ids)])

    async def broken() -> None:
        bad = _request(model, Pipeline.CHAT, {"messages": "not a list", "stream": True})
        await pipeline.InProcessDerender(model).stream(bad).steps([(_events(ids)[0], b"")])

    created = re.compile(rb'"created":\d+')  # (a second may pass between the two)
    assert created.sub(b"", asyncio.run(streamed())) == created.sub(b"", expected)
    with pytest.raises(GatewayError, match="derender failed"):
        asyncio.run(broken())


def test_a_request_render_validated_in_process_is_not_validated_again(model: Any) -> None:
    """Render in process hands derender vLLM's model of the request it validated (native
    serving's stream generator reads the object its render read): derender reads that one,
    and streams what it streams from its own validation of the body."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "tools": TOOLS}
    own = _request(model, Pipeline.CHAT, body)
    validated = ChatCompletionRequest.model_validate(own.request.body)
    shared = TokenizedRequest(replace(own.request, validated=validated), own.request_id, own.prompts)
    assert model.client_request(shared) is validated
    assert model.client_request(own) is not validated
    ids = _ids(model, "<think>\nhm\n</think>\n\nHello there" + EOS)
    created = re.compile(rb'"created":\d+')
    streamed = [_stream(model, r, _events(ids)) for r in (own, shared)]
    assert [created.sub(b"", orjson.dumps(c)) for c in streamed[0]] == [
        created.sub(b"", orjson.dumps(c)) for c in streamed[1]
    ]
