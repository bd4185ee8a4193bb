"""Conformance of Anthropic Messages: the gateway's `/v1/messages` answer must equal the
engine's own `/v1/messages` answer (`tito conformance --api messages`).

As for chat (`openai.py`), each case runs first against the engine, whose answer must show
the case's feature, then against the gateway. Random values are normalized away (message and
tool-use ids: present and stable; thinking signatures: present). Compared: the message's type,
role and model, every content block (text, thinking, tool input as parsed JSON), the stop
reason and sequence, the usage; for streams also the sequence of event types (each block's
run of deltas of one kind counted once: how many tokens a delta carries is not the promise),
with the framing a client relies on (`event:` naming each `data:`'s type, `message_start`
first, `message_stop` last, no `[DONE]`). Errors are compared by status and body.

No seed in Messages: every case samples greedily (temperature 0).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx

from ext_proc.tools.conformance.core import (
    Answer,
    BodyCase,
    Expect,
    Json,
    TypedStream,
    answer_of,
    http_status,
    in_both_modes,
    normalize_body_error,
    normalized_is,
    posted,
    present,
    run_with,
)
from ext_proc.tools.conformance.openai_cases import CITY_SCHEMA, ENGLISH, NO_THINK

PATH = "/v1/messages"
COUNT_PATH = "/v1/messages/count_tokens"


# --------------------------------------------------------------------------- answers


def _block(block: Mapping[str, Any]) -> Json:
    kind = block.get("type")
    if kind == "thinking":
        return {"type": kind, "thinking": block.get("thinking"), "signature": present(block.get("signature"))}
    if kind == "tool_use":
        return {"type": kind, "name": block.get("name"), "input": block.get("input"), "id": present(block.get("id"))}
    return {key: block.get(key) for key in ("type", "text")}


def normalize_message(body: Mapping[str, Any]) -> Answer:
    """A whole Messages answer."""
    return Answer(
        {
            "type": body.get("type"),
            "role": body.get("role"),
            "model": body.get("model"),
            "id": present(body.get("id")),
            "content": [_block(b) for b in body.get("content") or []],
            "stop_reason": body.get("stop_reason"),
            "stop_sequence": body.get("stop_sequence"),
            "usage": body.get("usage"),
        }
    )


@dataclass
class _Blocks:
    """Content blocks accumulated over a stream, as a client builds them."""

    blocks: dict[int, Json] = field(default_factory=dict)
    json_parts: dict[int, list[str]] = field(default_factory=dict)

    def start(self, index: int, block: Mapping[str, Any]) -> None:
        self.blocks[index] = dict(block)

    def delta(self, index: int, delta: Mapping[str, Any]) -> None:
        block = self.blocks.setdefault(index, {"type": "<no content_block_start>"})
        kind = delta.get("type")
        if kind == "text_delta":
            block["text"] = block.get("text", "") + str(delta.get("text"))
        elif kind == "thinking_delta":
            block["thinking"] = block.get("thinking", "") + str(delta.get("thinking"))
        elif kind == "signature_delta":
            block["signature"] = delta.get("signature")
        elif kind == "input_json_delta":
            self.json_parts.setdefault(index, []).append(str(delta.get("partial_json")))

    def finished(self) -> list[Json]:
        out = []
        for index, block in sorted(self.blocks.items()):
            if index in self.json_parts:
                text = "".join(self.json_parts[index])
                try:
                    block["input"] = json.loads(text)
                except json.JSONDecodeError:
                    block["input"] = {"<invalid JSON>": text}
            out.append(_block(block))
        return out


def _event_key(data: Mapping[str, Any]) -> str:
    delta = data.get("delta") or {}
    kind = str(data.get("type"))
    if kind == "content_block_delta":
        return f"{kind}[{data.get('index')}].{delta.get('type')}"
    if kind == "content_block_start":
        return f"{kind}[{data.get('index')}].{(data.get('content_block') or {}).get('type')}"
    return kind if "index" not in data else f"{kind}[{data['index']}]"


def normalize_stream(raw: bytes) -> Answer:
    stream = TypedStream.read(raw, "Messages", "message_start", "message_stop", _event_key)
    blocks = _Blocks()
    message: Json = {}
    usage: Json = {}
    stop: Json = {}
    error = None
    for _, data in stream.events:
        kind = data.get("type")
        if kind == "message_start":
            message = dict(data.get("message") or {})
            usage.update(message.get("usage") or {})
        elif kind == "content_block_start":
            blocks.start(int(data.get("index", -1)), data.get("content_block") or {})
        elif kind == "content_block_delta":
            blocks.delta(int(data.get("index", -1)), data.get("delta") or {})
        elif kind == "message_delta":
            stop = dict(data.get("delta") or {})
            usage.update(data.get("usage") or {})
        elif kind == "error":
            error = data.get("error")
    normalized = {
        "type": message.get("type"),
        "role": message.get("role"),
        "model": message.get("model"),
        "id": present(message.get("id")),
        "content": blocks.finished(),
        "stop_reason": stop.get("stop_reason"),
        "stop_sequence": stop.get("stop_sequence"),
        "usage": usage,
        "events": stream.sequence,
    }
    return stream.answer(normalized, error)


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class MessagesCase(BodyCase):
    path: str = PATH  # or COUNT_PATH, which takes no `stream`

    def request(self, model: str) -> Json:
        if self.path == PATH:
            return super().request(model)
        return {"model": model, **self.body}  # a case naming its own model keeps it


def _content(test: Callable[[Sequence[Json]], bool]) -> Callable[[Answer], bool]:
    return lambda a: test(a.normalized.get("content") or [])


def _has_block(kind: str) -> Expect:
    return Expect(f"a {kind} block", _content(lambda blocks: any(b["type"] == kind for b in blocks)))


TOOL = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "東京 🗼"]}},
        "required": ["city"],
    },
}
STRICT_TOOL = {**TOOL, "strict": True}
CITY_FORMAT = {"type": "json_schema", "schema": CITY_SCHEMA}
GREEDY = {"temperature": 0.0}
HISTORY: list[Json] = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        ],
    },
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"}]},
]
HAS_TEXT = _has_block("text")
HAS_THINKING = _has_block("thinking")
# Greedy JSON from a random-weight model pads with whitespace until max_tokens, so a forced
# call never completes on the real engine (Messages has no seed to sample one): a stream opens
# its tool_use block as the call starts, a whole answer keeps the unfinished call as text.
# Complete calls, whole and streamed: tests/integration/test_more_apis.py, on scripted tokens.
STREAMED_TOOL_USE = Expect(
    "a tool_use block when streamed",
    lambda a: "events" not in a.normalized or any(b["type"] == "tool_use" for b in a.normalized["content"]),
)


def _ask(user: str | list[Json], max_tokens: int, **extra: Any) -> Json:
    messages = [{"role": "user", "content": user}] if isinstance(user, str) else user
    return {"max_tokens": max_tokens, "messages": messages, **GREEDY, **extra}


SPECS: list[tuple[str, Json, tuple[Expect, ...]]] = [
    ("text", _ask(ENGLISH, 12, **NO_THINK), (HAS_TEXT, normalized_is("stop_reason", "max_tokens"))),
    ("thinking", _ask(ENGLISH, 12), (HAS_THINKING,)),
    ("thinking-disabled", _ask(ENGLISH, 8, thinking={"type": "disabled"}), ()),
    ("system-string", _ask(ENGLISH, 8, system="You are terse.", **NO_THINK), (HAS_TEXT,)),
    (
        "system-blocks",
        _ask(ENGLISH, 8, system=[{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Be kind."}]),
        (),
    ),
    (
        "inline-system",
        _ask([{"role": "user", "content": ENGLISH}, {"role": "system", "content": "Answer in French."}], 8, **NO_THINK),
        (HAS_TEXT,),
    ),
    ("json-format", _ask(ENGLISH, 40, output_config={"format": CITY_FORMAT}, **NO_THINK), (HAS_TEXT,)),
    # the stop string ends inside a token: the text before it is held back, then cut
    (
        "stop-sequence",
        _ask(ENGLISH, 16, stop_sequences=["think"], **NO_THINK),
        (normalized_is("stop_reason", "stop_sequence"), HAS_TEXT),
    ),
    ("stop-in-thinking", _ask(ENGLISH, 16, stop_sequences=["ant"]), (normalized_is("stop_reason", "stop_sequence"),)),
    (
        "tool-named",
        _ask(ENGLISH, 24, tools=[STRICT_TOOL], tool_choice={"type": "tool", "name": "get_weather"}, **NO_THINK),
        (STREAMED_TOOL_USE,),
    ),
    ("tool-any", _ask(ENGLISH, 24, tools=[STRICT_TOOL], tool_choice={"type": "any"}, **NO_THINK), (STREAMED_TOOL_USE,)),
    ("tool-auto", _ask(ENGLISH, 10, tools=[TOOL], tool_choice={"type": "auto"}, **NO_THINK), ()),
    ("tool-none", _ask(ENGLISH, 10, tools=[TOOL], tool_choice={"type": "none"}, **NO_THINK), (HAS_TEXT,)),
    ("tool-result", _ask(HISTORY, 10, tools=[TOOL], **NO_THINK), ()),
]
CASES: list[MessagesCase] = in_both_modes(MessagesCase, "messages", SPECS) + [
    MessagesCase(
        "messages-count-tokens", {"messages": HISTORY, "tools": [TOOL], "system": "Be terse."}, path=COUNT_PATH
    ),
    MessagesCase(
        "messages-error-no-max-tokens", {"messages": [{"role": "user", "content": "hi"}]}, (http_status(400),)
    ),
    MessagesCase("messages-error-unknown-model", {**_ask("hi", 4), "model": "no-such-model"}, (http_status(404),)),
    MessagesCase("messages-error-too-long", _ask("hi " * 5000, 4), (http_status(400),)),
    MessagesCase("messages-error-too-long-stream", _ask("hi " * 5000, 4), (http_status(400),), stream=True),
]


# --------------------------------------------------------------------------- running


def fetch(client: httpx.Client, base_url: str, case: MessagesCase, model: str) -> Answer:
    answer = posted(client, base_url, case.path, case.request(model))
    whole = (lambda body: Answer({"body": body})) if case.path == COUNT_PATH else normalize_message
    return answer_of(answer, case.stream, normalize_body_error, normalize_stream, whole)


run_case = partial(run_with, fetch)
