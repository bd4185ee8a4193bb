"""A derender model's parser engines start from a prototype per config (`parser_shapes.py`):
clients get byte for byte what parsers built entirely by vLLM's own code send, an engine so
made has the fields vLLM's own `__init__` gives it, and sessions running side by side share
no state but the prototype's read-only parts."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from ext_proc.derender import parser_shapes
from ext_proc.derender.parser_shapes import SharedEngines
from ext_proc.protocol import OpenAIRequest, Pipeline, PromptTokens, TokenizedRequest

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
EOS = "<|im_end|>"
REASONED = "<think>\nthe robot<|im_start|> thinks 東京\n</think>\n\nhello 世界 🐉🚀" + EOS
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京 🗼"}}\n</tool_call>' + EOS
THOUGHT_CALL = "<think>\nhm\n</think>\n\n" + CALL
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}

Run = Callable[[], list[bytes]]


@pytest.fixture
def model(derender_model: Any) -> Any:
    return derender_model


@pytest.fixture
def engine() -> Any:
    from vllm.parser.engine.streaming_parser_engine import StreamingParserEngine

    return StreamingParserEngine


@pytest.fixture(autouse=True)
def repeatable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same clock for every run (`created`); tool call ids are made repeatable per run."""
    monkeypatch.setattr("time.time", lambda: 1_700_000_000.0)


def _ids_from_zero() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"{next(counter):032x}"


def _request(model: Any, body: dict[str, Any]) -> TokenizedRequest:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True, **body}
    prompt = [int(t) for t in model.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")]
    rendered = {"token_ids": prompt, "sampling_params": {"skip_special_tokens": False}, "request_id": "chatcmpl-t"}
    return TokenizedRequest(OpenAIRequest(Pipeline.CHAT, body), "chatcmpl-t", [PromptTokens.rendered(rendered)])


def _events(model: Any, texts: dict[int, str]) -> list[dict[str, Any]]:
    """One event per step, every choice's next id in it, until each choice has finished."""
    ids = {i: [int(t) for t in model.tokenizer.encode(text)] for i, text in texts.items()}
    events = []
    for step in range(max(len(v) for v in ids.values())):
        choices = [
            {
                "index": i,
                "token_ids": [v[step]],
                "finish_reason": "stop" if step == len(v) - 1 else None,
                "stop_reason": None,
            }
            for i, v in ids.items()
            if step < len(v)
        ]
        events.append({"choices": choices})
    return [*events, {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}]


def _stream(model: Any, request: TokenizedRequest, events: list[dict[str, Any]]) -> list[bytes]:
    from ext_proc.derender.in_process import stream_session

    session = stream_session(model, request)
    return [session.steps([event]) for event in events]


def _as_vllm_builds(engine: Any, monkeypatch: pytest.MonkeyPatch, run: Run) -> list[bytes]:
    """What `run` sends when every parser engine is made by vLLM's own `__init__`."""
    assert parser_shapes._shared is not None
    with monkeypatch.context() as m:
        m.setattr(engine, "__init__", parser_shapes._shared.init)
        m.setattr("vllm.renderers.chat_utils.random_uuid", _ids_from_zero())
        return run()


def _same_as_vllm(engine: Any, monkeypatch: pytest.MonkeyPatch, run: Run) -> list[bytes]:
    reference = _as_vllm_builds(engine, monkeypatch, run)
    monkeypatch.setattr("vllm.renderers.chat_utils.random_uuid", _ids_from_zero())
    shared = run()
    assert shared == reference
    return shared


def _joined(chunks: list[bytes], key: str) -> str:
    events = [e.removeprefix(b"data: ") for e in b"".join(chunks).split(b"\n\n") if e]
    deltas = [choice["delta"] for e in events for choice in orjson.loads(e)["choices"]]
    return "".join(str(delta.get(key) or "") for delta in deltas)


def _parsers(session: Any) -> list[Any]:
    return [choice.parser for choice in session._choices.values()]


def _engine_of(parser: Any) -> Any:
    """The streaming engine inside the qwen3 reasoning parser."""
    return parser.reasoning_parser._parser_engine._engine


def test_the_tiny_model_has_special_tokens_to_drop(model: Any, engine: Any) -> None:
    """Else the cases below would not reach the shared lexer at all."""
    from ext_proc.derender.in_process import stream_session

    assert engine.__init__ is parser_shapes._from_prototype
    session = stream_session(model, _request(model, {}))
    assert _engine_of(_parsers(session)[0])._has_drops


@pytest.mark.parametrize(
    ("body", "text", "key", "shown"),
    [
        pytest.param(
            NO_THINKING,
            "hello 世界,<|im_start|> plain 🐉" + EOS,
            "content",
            "世界,<|im_start|> plain",
            id="plain-content",
        ),
        pytest.param({}, REASONED, "reasoning", "the robot thinks 東京", id="reasoning-then-content"),
        pytest.param({"tools": TOOLS, **NO_THINKING}, CALL, "tool_calls", "get_weather", id="hermes-tool-call"),
        pytest.param(
            {"tools": TOOLS, "stream_options": {"include_usage": True}},
            REASONED,
            "content",
            "hello",
            id="tools-offered",
        ),
    ],
)
def test_one_choice_is_byte_identical(
    model: Any, engine: Any, monkeypatch: pytest.MonkeyPatch, body: dict[str, Any], text: str, key: str, shown: str
) -> None:
    request = _request(model, body)
    events = _events(model, {0: text})
    chunks = _same_as_vllm(engine, monkeypatch, lambda: _stream(model, request, events))
    assert shown in _joined(chunks, key)  # the comparison is of real output, not of empty streams


def test_two_choices_are_byte_identical(model: Any, engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    request = _request(model, {"n": 2, "tools": TOOLS, "stream_options": {"include_usage": True}})
    events = _events(model, {0: REASONED, 1: THOUGHT_CALL})
    chunks = _same_as_vllm(engine, monkeypatch, lambda: _stream(model, request, events))
    assert b'"index":1' in b"".join(chunks) and "get_weather" in _joined(chunks, "tool_calls")


def test_two_sessions_side_by_side_share_no_state(model: Any, engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two streams with the same tools, their steps interleaved, each sends what it sends alone;
    their parsers have the one special-token lexer shape in common, nothing else."""
    from ext_proc.derender.in_process import stream_session

    calling = (_request(model, {"tools": TOOLS}), _events(model, {0: THOUGHT_CALL}))
    reasoning = (_request(model, {"tools": TOOLS}), _events(model, {0: REASONED}))
    alone = [
        _as_vllm_builds(engine, monkeypatch, lambda r=r, e=e: _stream(model, r, e)) for r, e in (calling, reasoning)
    ]

    monkeypatch.setattr("vllm.renderers.chat_utils.random_uuid", _ids_from_zero())
    sessions = [stream_session(model, calling[0]), stream_session(model, reasoning[0])]
    sent: list[list[bytes]] = [[], []]
    for step in range(max(len(calling[1]), len(reasoning[1]))):
        for i, (session, events) in enumerate(zip(sessions, (calling[1], reasoning[1]), strict=True)):
            if step < len(events):
                sent[i].append(session.steps([events[step]]))
    assert sent == alone

    a, b = (_engine_of(_parsers(s)[0]) for s in sessions)
    assert a._lexer._shape is b._lexer._shape  # the shared, read-only part
    assert a is not b and a._lexer is not b._lexer and a._scanner is not b._scanner
    assert a._resolved_token_ids == b._resolved_token_ids and a._resolved_token_ids is not b._resolved_token_ids
    assert a._scanner._deferred_terminals is not b._scanner._deferred_terminals
    assert a._lexer._token_counts is not b._lexer._token_counts
    tool_a, tool_b = (_parsers(s)[0].tool_parser for s in sessions)
    assert tool_a.prev_tool_call_arr is not tool_b.prev_tool_call_arr


def test_a_whole_answer_is_byte_identical(model: Any, engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole answers build a parser per choice and one more to count reasoning tokens."""
    from ext_proc.derender.in_process import derender_whole

    request = _request(model, {"tools": TOOLS, "n": 2, "stream": False})
    generate = {
        "choices": [
            {"index": i, "token_ids": [int(t) for t in model.tokenizer.encode(text)], "finish_reason": "stop"}
            for i, text in enumerate((REASONED, THOUGHT_CALL))
        ]
    }
    _same_as_vllm(engine, monkeypatch, lambda: [derender_whole(model, request, generate)])


def _fields(engine: Any) -> dict[str, Any]:
    """An engine's fields, its scanner's, lexer's and lexer shape's by value."""
    fields = dict(vars(engine))
    for part in ("_scanner", "_lexer"):
        fields[part] = dict(vars(fields[part]))
    shape = fields["_lexer"]["_shape"]
    fields["_lexer"]["_shape"] = {name: getattr(shape, name) for name in type(shape).__slots__}
    return fields


@pytest.mark.parametrize("body", [{}, NO_THINKING, {"tools": TOOLS}], ids=["thinking", "no-thinking", "tools"])
def test_an_engine_from_the_prototype_has_the_fields_vllm_gives_it(
    model: Any, engine: Any, body: dict[str, Any]
) -> None:
    from ext_proc.derender.in_process import stream_session

    made = _engine_of(_parsers(stream_session(model, _request(model, body)))[0])
    assert parser_shapes._shared is not None
    own = engine.__new__(engine)
    parser_shapes._shared.init(own, made.config, model.tokenizer, vocab=model.tokenizer.get_vocab())
    assert _fields(made) == _fields(own)


def test_vllm_makes_one_prototype_per_config_for_a_registered_tokenizer(model: Any, engine: Any) -> None:
    from ext_proc.derender.in_process import stream_session

    assert parser_shapes._shared is not None
    own, made = parser_shapes._shared.init, []

    def init(engine: Any, config: Any, tokenizer: Any, initial_state: Any = None, vocab: Any = None) -> None:
        made.append(config)
        own(engine, config, tokenizer, initial_state=initial_state, vocab=vocab)

    thinking, not_thinking = (
        _engine_of(_parsers(stream_session(model, _request(model, body)))[0]).config for body in ({}, NO_THINKING)
    )
    assert thinking is not not_thinking
    shared = SharedEngines(init)
    shared.add(model.tokenizer)
    for config in (thinking, thinking, not_thinking, thinking, not_thinking):
        shared.make(engine.__new__(engine), config, model.tokenizer)
    assert made == [thinking, not_thinking]
    vocab = dict(model.tokenizer.get_vocab())  # not the tokenizer's own: vLLM's `__init__`, every time
    for _ in range(2):
        shared.make(engine.__new__(engine), thinking, model.tokenizer, vocab=vocab)
    assert made == [thinking, not_thinking, thinking, thinking]
