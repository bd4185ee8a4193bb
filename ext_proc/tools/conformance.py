"""Conformance: the gateway's OpenAI answer must equal the engine's native OpenAI answer.

For the same engine, seed and request, vLLM's own `/v1/chat/completions` and `/v1/completions`
are the reference: whatever render → token-only generate → derender hands a client must be what
the engine would have answered itself, field by field. Each case is a request (data, not code)
run first against the native endpoint, whose answer must show the feature the case is about
(otherwise the case proves nothing and is reported `BROKEN CASE`), then against the gateway.
Both answers are normalized per choice (streams concatenated, tool-call ids reduced to
"present and stable", ids/timestamps dropped) and compared; streams are also read as raw SSE
to check the framing a client relies on (one `data: [DONE]` at the end, one `id`, the chunk
`object`). An error is an answer too: its status and error object (type, message, param,
code) are compared, in the body or as a stream's in-band error event.

`tito conformance --gateway URL --native URL --model NAME [--only SUBSTRING] [--api ...]` prints
one line per case and exits non-zero on any difference; the e2e tests run the same cases. The
Anthropic Messages cases are `messages_conformance.py`'s, OpenAI Responses cases
`responses_conformance.py`'s.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import httpx

from ext_proc.tools.tiny_model import SPECIAL_TOKENS

Api = Literal["chat", "completions"]
Status = Literal["PASS", "FAIL", "BROKEN CASE"]
Json = dict[str, Any]

PATHS: dict[Api, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
CHUNK_OBJECT: dict[Api, str] = {"chat": "chat.completion.chunk", "completions": "text_completion"}
MAX_REPORTED = 6  # differences shown per case by default; the first ones say the most
ABSENT: Any = object()  # a key one side has and the other lacks


# --------------------------------------------------------------------------- answers


@dataclass
class Answer:
    """One endpoint's answer, reduced to what a client may rely on.

    `normalized` holds `object`, `model`, `choices` (by index, as strings so JSON-like paths
    read naturally) and `usage`; `problems` are SSE framing violations; `error` is set when
    there was no usable answer at all (transport error, non-200, unparsable body).
    """

    normalized: Json = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def choices(self) -> list[Json]:
        return [self.normalized["choices"][k] for k in sorted(self.normalized.get("choices", {}), key=int)]

    @property
    def usage(self) -> Json | None:
        usage: Json | None = self.normalized.get("usage")
        return usage


def _tool_call(name: str | None, arguments: str | None, call_type: str | None, id_state: str) -> Json:
    """A tool call as compared: ids are random per server, so only their state counts;
    arguments are compared as parsed JSON (key order and spacing are not the promise)."""
    try:
        parsed: Any = json.loads(arguments) if arguments is not None else None
    except json.JSONDecodeError:
        parsed = {"<invalid JSON>": arguments}
    return {"type": call_type, "name": name, "arguments": parsed, "id": id_state}


def _chat_logprob(entry: Mapping[str, Any]) -> Json:
    top = [
        {"token": t.get("token"), "logprob": t.get("logprob"), "bytes": t.get("bytes")}
        for t in entry.get("top_logprobs") or []
    ]
    return {
        "token": entry.get("token"),
        "logprob": entry.get("logprob"),
        "bytes": entry.get("bytes"),
        "top_logprobs": top,
    }


def _usage(raw: Mapping[str, Any] | None) -> Json | None:
    if raw is None:
        return None
    keys = ("prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details", "completion_tokens_details")
    return {key: raw.get(key) for key in keys}


def _normalize_chat_choice(choice: Mapping[str, Any]) -> Json:
    message = choice.get("message") or {}
    calls = [
        _tool_call(
            (c.get("function") or {}).get("name"),
            (c.get("function") or {}).get("arguments"),
            c.get("type"),
            "present" if c.get("id") else "missing",
        )
        for c in message.get("tool_calls") or []
    ]
    logprobs = choice.get("logprobs")
    return {
        "role": message.get("role"),
        "content": message.get("content"),
        "reasoning": message.get("reasoning"),
        "tool_calls": calls,
        "finish_reason": choice.get("finish_reason"),
        "stop_reason": choice.get("stop_reason"),
        "logprobs": None if logprobs is None else [_chat_logprob(e) for e in logprobs.get("content") or []],
    }


def _completion_logprobs(raw: Mapping[str, Any] | None) -> Json | None:
    if raw is None:
        return None
    return {key: raw.get(key) for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def _normalize_completion_choice(choice: Mapping[str, Any]) -> Json:
    return {
        "text": choice.get("text"),
        "finish_reason": choice.get("finish_reason"),
        "stop_reason": choice.get("stop_reason"),
        "logprobs": _completion_logprobs(choice.get("logprobs")),
        "prompt_logprobs": choice.get("prompt_logprobs"),
        "prompt_token_ids": choice.get("prompt_token_ids"),
    }


def normalize_full(api: Api, body: Mapping[str, Any]) -> Answer:
    """A non-streaming JSON answer."""
    normalize = _normalize_chat_choice if api == "chat" else _normalize_completion_choice
    choices = {str(c.get("index")): normalize(c) for c in body.get("choices") or []}
    normalized = {
        "object": body.get("object"),
        "model": body.get("model"),
        "choices": choices,
        "usage": _usage(body.get("usage")),
    }
    if api == "chat":
        normalized["prompt_logprobs"] = body.get("prompt_logprobs")
    return Answer(normalized)


def _error(raw: Any) -> Json:
    """An OpenAI error object as compared: what a client reads of it."""
    error = raw if isinstance(raw, dict) else {"message": raw}
    return {key: error.get(key) for key in ("type", "message", "param", "code")}


def normalize_error(status: int, raw: bytes) -> Answer:
    """A non-200 answer: its status and error object (no usable answer: `error`)."""
    try:
        body = json.loads(raw)
    except json.JSONDecodeError:
        body = None
    if not isinstance(body, dict) or "error" not in body:
        return Answer(error=f"HTTP {status} {raw[:200].decode(errors='replace')}")
    return Answer({"status": status, "error": _error(body["error"])})


# --------------------------------------------------------------------------- streams


def split_sse(raw: bytes) -> tuple[list[str], list[str]]:
    """The `data:` payloads of an SSE body, plus framing problems (lines that are not data,
    comments excepted). Accepts LF, CRLF and CR line ends and `data:` with or without space."""
    text = raw.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    payloads: list[str] = []
    problems: list[str] = []
    for event in text.split("\n\n"):
        data = []
        for line in event.split("\n"):
            if line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
            elif line and not line.startswith(":"):
                problems.append(f"non-data SSE line {line[:60]!r}")
        if data:
            payloads.append("\n".join(data))
    return payloads, problems


def _framing_problems(api: Api, payloads: Sequence[str], chunks: Sequence[Json]) -> list[str]:
    """What every OpenAI stream promises: `[DONE]` exactly once and last, one id, the chunk object."""
    problems = []
    done = sum(1 for p in payloads if p.strip() == "[DONE]")
    if done != 1 or not payloads or payloads[-1].strip() != "[DONE]":
        problems.append(f"stream: {done} `data: [DONE]` events, last event {payloads[-1][:40] if payloads else None!r}")
    ids = sorted({str(c.get("id")) for c in chunks})
    if len(ids) > 1:
        problems.append(f"stream: {len(ids)} different chunk ids {ids[:3]}")
    objects = sorted({str(c.get("object")) for c in chunks if "error" not in c} - {CHUNK_OBJECT[api]})
    if objects:
        problems.append(f"stream: chunk object {objects} instead of {CHUNK_OBJECT[api]!r}")
    errors = [c for c in chunks if "error" in c]
    if len(errors) > 1 or (errors and chunks[-1] is not errors[0]):
        problems.append("stream: an error event that is not the stream's last")
    return problems


def _decode_chunks(payloads: Iterable[str]) -> tuple[list[Json], list[str]]:
    chunks: list[Json] = []
    problems: list[str] = []
    for payload in payloads:
        if payload.strip() == "[DONE]":
            continue
        try:
            chunks.append(json.loads(payload))
        except json.JSONDecodeError:
            problems.append(f"stream: unparsable event {payload[:60]!r}")
    return chunks, problems


@dataclass
class _StreamChoice:
    """One choice accumulated over a stream, as a client concatenates it."""

    role: str | None = None
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tools: dict[int, Json] = field(default_factory=dict)
    finish_reason: str | None = None
    stop_reason: Any = None
    logprobs: list[Any] | None = None
    text_logprobs: Json | None = None
    prompt_token_ids: list[int] | None = None

    def add_tool_delta(self, delta: Mapping[str, Any]) -> None:
        acc = self.tools.setdefault(
            int(delta.get("index", 0)), {"ids": [], "name": "", "arguments": None, "type": None}
        )
        if delta.get("id"):
            acc["ids"].append(delta["id"])
        function = delta.get("function") or {}
        acc["name"] += function.get("name") or ""
        if function.get("arguments") is not None:
            acc["arguments"] = (acc["arguments"] or "") + function["arguments"]
        acc["type"] = acc["type"] or delta.get("type")

    def tool_calls(self) -> list[Json]:
        calls = []
        for _, acc in sorted(self.tools.items()):
            ids = set(acc["ids"])
            state = "missing" if not ids else "present" if len(ids) == 1 else f"unstable ({len(ids)} ids)"
            calls.append(_tool_call(acc["name"] or None, acc["arguments"], acc["type"], state))
        return calls


def _joined(parts: list[str]) -> str | None:
    """Concatenated deltas; nothing at all reads as absent (a stream has no `null` content)."""
    return "".join(parts) or None


def _feed_chat(acc: _StreamChoice, choice: Mapping[str, Any]) -> None:
    delta = choice.get("delta") or {}
    acc.role = acc.role or delta.get("role")
    acc.content.append(delta.get("content") or "")
    acc.reasoning.append(delta.get("reasoning") or "")
    for call in delta.get("tool_calls") or []:
        acc.add_tool_delta(call)
    logprobs = choice.get("logprobs")
    if logprobs is not None:
        acc.logprobs = (acc.logprobs or []) + [_chat_logprob(e) for e in logprobs.get("content") or []]


def _feed_completion(acc: _StreamChoice, choice: Mapping[str, Any]) -> None:
    acc.content.append(choice.get("text") or "")
    acc.prompt_token_ids = acc.prompt_token_ids or choice.get("prompt_token_ids")
    logprobs = _completion_logprobs(choice.get("logprobs"))
    if logprobs is not None:
        merged = acc.text_logprobs or {key: [] for key in logprobs}
        for key, values in logprobs.items():
            merged[key] = merged[key] + list(values or [])
        acc.text_logprobs = merged


def _finish_choice(api: Api, acc: _StreamChoice) -> Json:
    if api == "completions":
        text = "".join(acc.content)
        return {
            "text": text,
            "finish_reason": acc.finish_reason,
            "stop_reason": acc.stop_reason,
            "logprobs": acc.text_logprobs,
            "prompt_logprobs": None,  # never streamed
            "prompt_token_ids": acc.prompt_token_ids,
        }
    return {
        "role": acc.role,
        "content": _joined(acc.content),
        "reasoning": _joined(acc.reasoning),
        "tool_calls": acc.tool_calls(),
        "finish_reason": acc.finish_reason,
        "stop_reason": acc.stop_reason,
        "logprobs": acc.logprobs,
    }


def _one(values: set[Any]) -> Any:
    """The value every chunk agrees on, else all of them (which then differs from native)."""
    return next(iter(values)) if len(values) == 1 else sorted(map(str, values))


def normalize_stream(api: Api, raw: bytes) -> Answer:
    """A streamed answer: framing checked, then every choice's deltas concatenated."""
    payloads, problems = split_sse(raw)
    chunks, decode_problems = _decode_chunks(payloads)
    problems += decode_problems + _framing_problems(api, payloads, chunks)
    accs: dict[int, _StreamChoice] = {}
    usage: Json | None = None
    feed = _feed_chat if api == "chat" else _feed_completion
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            acc = accs.setdefault(int(choice.get("index", 0)), _StreamChoice())
            feed(acc, choice)
            acc.finish_reason = choice.get("finish_reason") or acc.finish_reason
            if choice.get("stop_reason") is not None:
                acc.stop_reason = choice["stop_reason"]
        if chunk.get("usage") is not None:
            usage = chunk["usage"]
    data = [c for c in chunks if "error" not in c]
    normalized = {
        "object": _one({c.get("object") for c in data}) if data else None,
        "model": _one({c.get("model") for c in data}) if data else None,
        "choices": {str(i): _finish_choice(api, acc) for i, acc in sorted(accs.items())},
        "usage": _usage(usage),
    }
    if api == "chat":
        normalized["prompt_logprobs"] = None  # never streamed
    errors = [c["error"] for c in chunks if "error" in c]
    if errors:
        normalized["error"] = _error(errors[0])
    return Answer(normalized, problems)


# --------------------------------------------------------------------------- comparison


def _short(value: Any) -> str:
    if value is ABSENT:
        return "<absent>"
    if isinstance(value, list) and len(value) > 3:
        return f"[{len(value)} items]"
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."


def _string_difference(path: str, gateway: str, native: str) -> str:
    """Two texts shown from where they part (long texts would hide the difference)."""
    at = next(
        (i for i, (g, n) in enumerate(zip(gateway, native, strict=False)) if g != n), min(len(gateway), len(native))
    )
    start = max(0, at - 10)
    tail = f" (from char {start} of {len(gateway)} vs {len(native)})" if start else ""
    return f"{path}: gateway {_short(gateway[start:])} vs native {_short(native[start:])}{tail}"


def _key_path(path: str, key: Any) -> str:
    """`a.b` for names, `a["?"]` for the odd keys of completions' top_logprobs (token texts)."""
    name = str(key)
    if name.isidentifier() or name.isdigit():
        return f"{path}.{name}" if path else name
    return f"{path}[{json.dumps(name, ensure_ascii=False)}]"


def differences(gateway: Any, native: Any, path: str = "") -> list[str]:
    """Every leaf where the two normalized answers differ, as `path: gateway X vs native Y`.
    Floats compare exactly: same engine, same seed, same prompt ids give the same numbers."""
    if isinstance(gateway, dict) and isinstance(native, dict):
        out: list[str] = []
        for key in list(native) + [k for k in gateway if k not in native]:
            out += differences(gateway.get(key, ABSENT), native.get(key, ABSENT), _key_path(path, key))
        return out
    if isinstance(gateway, list) and isinstance(native, list):
        out = [f"{path}: gateway {len(gateway)} items vs native {len(native)}"] if len(gateway) != len(native) else []
        for i, (g, n) in enumerate(zip(gateway, native, strict=False)):
            out += differences(g, n, f"{path}[{i}]")
        return out
    if gateway == native and type(gateway) is type(native):
        return []
    if isinstance(gateway, str) and isinstance(native, str):
        return [_string_difference(path, gateway, native)]
    return [f"{path}: gateway {_short(gateway)} vs native {_short(native)}"]


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Expect:
    """What the native answer must show for the case to exercise its feature."""

    feature: str
    holds: Callable[[Answer], bool]


@dataclass(frozen=True)
class Spec:
    """One request shape; it runs streaming and non-streaming (`Case`s)."""

    name: str
    api: Api
    body: Mapping[str, Any]  # the request without model and stream
    expect: tuple[Expect, ...]
    stream_usage: bool = False  # streams ask for `stream_options.include_usage`
    streams: tuple[bool, ...] = (False, True)  # the modes the case runs in

    def cases(self) -> list[Case]:
        return [Case(self, stream) for stream in self.streams]


@dataclass(frozen=True)
class Case:
    spec: Spec
    stream: bool

    @property
    def name(self) -> str:
        return f"{self.spec.api}-{self.spec.name}-{'stream' if self.stream else 'full'}"

    @property
    def api(self) -> Api:
        return self.spec.api

    def request(self, model: str) -> Json:
        body: Json = {"model": model, **self.spec.body, "stream": self.stream}
        if self.stream and self.spec.stream_usage:
            body["stream_options"] = {"include_usage": True}
        return body


def _text(choice: Mapping[str, Any]) -> str:
    """The generated visible text of a choice, whatever the API."""
    return str(choice.get("content") or choice.get("text") or "")


def _all(test: Callable[[Json], bool]) -> Callable[[Answer], bool]:
    return lambda a: bool(a.choices) and all(test(c) for c in a.choices)


def _finish(reason: str) -> Expect:
    return Expect(f"finish_reason {reason!r}", _all(lambda c: c["finish_reason"] == reason))


def _tool_names(names: Sequence[str]) -> Expect:
    return Expect(f"tool calls {list(names)}", _all(lambda c: [t["name"] for t in c["tool_calls"]] == list(names)))


def _usage_above(field_name: str, minimum: int) -> Expect:
    return Expect(
        f"usage.{field_name} > {minimum}", lambda a: a.usage is not None and (a.usage.get(field_name) or 0) > minimum
    )


def _json_content(choice: Mapping[str, Any]) -> bool:
    try:
        return isinstance(json.loads(_text(choice)), dict)
    except json.JSONDecodeError:
        return False


def _reasoning_tokens(answer: Answer) -> int:
    details = (answer.usage or {}).get("completion_tokens_details") or {}
    return int(details.get("reasoning_tokens") or 0)


def _chat_top2(choice: Mapping[str, Any]) -> bool:
    entries = choice.get("logprobs") or []
    return bool(entries) and all(len(e["top_logprobs"]) == 2 for e in entries)


def _completion_top2(choice: Mapping[str, Any]) -> bool:
    logprobs = choice.get("logprobs") or {}
    return bool(logprobs.get("tokens")) and all(len(t or {}) >= 2 for t in logprobs.get("top_logprobs") or [None])


def _id_tokens(choice: Mapping[str, Any]) -> bool:
    """Every logprob token named by its id (`return_tokens_as_token_ids`)."""
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):  # completions
        tokens = list(logprobs.get("tokens") or []) + [
            t for top in logprobs.get("top_logprobs") or [] for t in top or {}
        ]
    else:
        tokens = [e["token"] for e in logprobs or []] + [t["token"] for e in logprobs or [] for t in e["top_logprobs"]]
    return bool(tokens) and all(t.startswith("token_id:") for t in tokens)


HAS_CONTENT = Expect("non-empty text", _all(lambda c: bool(_text(c))))
HAS_REASONING = Expect("reasoning", _all(lambda c: bool(c.get("reasoning"))))
NO_CONTENT = Expect("no content", _all(lambda c: c.get("content") is None))
NON_ASCII = Expect("non-ASCII text", _all(lambda c: any(ord(ch) > 127 for ch in _text(c))))
# More tokens than characters: at least one character was split across tokens.
SPLIT_CHARS = Expect(
    "characters split across tokens",
    lambda a: a.usage is not None and len(a.choices) == 1 and a.usage["completion_tokens"] > len(_text(a.choices[0])),
)
TWO_CHOICES = Expect(
    "2 different choices",
    lambda a: len(a.choices) == 2 and len({_text(c) + str(c.get("reasoning")) for c in a.choices}) == 2,
)

# Chat without thinking: the prompt closes the think block, so the reasoning parser lets
# structured outputs apply from the first token (with thinking on, vLLM holds them back until
# the model ends its reasoning, which a random-weight model never does).
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
# Completions have no template: the prompt itself closes the think block, for the same reason.
CLOSED_THINK = "</think>\n\n"
# The tiny model's `</think>`: a logit bias makes the model end its reasoning after a few tokens.
THINK_END_ID = SPECIAL_TOKENS.index("</think>")
SAMPLING = {"temperature": 1.0}
WEATHER_TOOL: Json = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "東京 🗼"]}},
            "required": ["city"],
        },
    },
}
# Strict: a named tool_choice then constrains the arguments to the schema (otherwise any JSON,
# which a random model rarely closes). Not for tool_choice=auto, where strictness would replace
# the cases' hermes regex with vLLM's own tool grammar.
STRICT_WEATHER_TOOL: Json = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "東京 🗼"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WORDS_REGEX = r"[a-z]{2,8}( [a-z]{2,8}){2,4}\."
LETTERS_REGEX = "[a-z ]{20,40}"
# Rare characters: not in the tiny tokenizer's vocabulary, so each is split into byte tokens.
RARE_CJK_EMOJI_REGEX = "[鯨鰻齉龘鱈🦑🪐🧭]{4,10}"
ENGLISH = "Tell me a story about a brave little robot."
CJK_EMOJI = "用中文讲个故事 🐉🚀，然后说 こんにちは 👋🏽"


def hermes_tool_call_regex(*cities: str) -> str:
    """A regex for hermes `<tool_call>` blocks (the tiny model's chat template format): with it
    a random-weight model emits exactly these calls, so the tool parser has real work."""
    block = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "CITY"\}\}\n</tool_call>'
    return "\n".join(block.replace("CITY", f"({city})") for city in cities)  # cities: no regex syntax


def _chat(user: str, seed: int, **extra: Any) -> Json:
    return {"messages": [{"role": "user", "content": user}], "seed": seed, **SAMPLING, **extra}


def _constrained_chat(user: str, seed: int, **extra: Any) -> Json:
    return _chat(user, seed, **NO_THINK, **extra)


def _completion(prompt: str, seed: int, **extra: Any) -> Json:
    return {"prompt": prompt, "seed": seed, **SAMPLING, **extra}


def _constrained_completion(prompt: str, seed: int, **extra: Any) -> Json:
    return _completion(prompt + CLOSED_THINK, seed, **extra)


def _regex(regex: str) -> Json:
    return {"structured_outputs": {"regex": regex}}


def _tools(seed: int, *cities: str, **extra: Any) -> Json:
    regex = hermes_tool_call_regex(*cities)
    return _constrained_chat(
        "What is the weather?", seed, tools=[WEATHER_TOOL], max_tokens=80, **_regex(regex), **extra
    )


def _matches(regex: str) -> Expect:
    return Expect(f"text matching {regex!r}", _all(lambda c: re.fullmatch(regex, _text(c)) is not None))


def _stop_reason(value: str) -> Expect:
    return Expect(f"stop_reason {value!r}", _all(lambda c: c["stop_reason"] == value))


def _tool_arguments(arguments: Json) -> Expect:
    return Expect(
        f"tool arguments {arguments}", _all(lambda c: [t["arguments"] for t in c["tool_calls"]] == [arguments])
    )


COMPLETION_TOKENS_16 = Expect("usage.completion_tokens == 16", lambda a: (a.usage or {}).get("completion_tokens") == 16)
# `max_tokens: 0` with echo: the engine still generates (and native counts) one token
COMPLETION_TOKENS_1 = Expect("usage.completion_tokens == 1", lambda a: (a.usage or {}).get("completion_tokens") == 1)
# vLLM's streaming count skips a token whose text is still an incomplete character unless it
# shares a chunk with the next one, so it depends on chunk timing; a seed whose every reasoning
# token has text counts them all, however the stream is chunked.
ALL_REASONING_COUNTED = Expect(
    "usage.completion_tokens_details.reasoning_tokens == completion_tokens > 0",
    lambda a: 0 < _reasoning_tokens(a) == (a.usage or {}).get("completion_tokens"),
)
CHAT_TOP2 = Expect("logprobs with 2 top_logprobs", _all(_chat_top2))
ID_TOKENS = Expect("logprob tokens as token ids", _all(_id_tokens))
COMPLETION_TOP2 = Expect("logprobs with 2 top_logprobs", _all(_completion_top2))
JSON_OBJECT = Expect("a JSON object", _all(_json_content))
NAMED_TOOL = {"type": "function", "function": {"name": "get_weather"}}
# No max_tokens: chat's default is the rest of the context (a regex keeps the answer short but
# longer than 16 tokens, so a gateway defaulting to 16 would cut it); completions' default is 16.
LONG_WORDS_REGEX = r"([a-z]{1,5} ){20,24}end\."

# What evaluation harnesses send: lm-eval scores a continuation through an OpenAI endpoint by
# echoing context + continuation with the prompt's logprobs and no new tokens.
LOGLIKELIHOOD = "Question: what is the capital of France?\nAnswer: Paris"
TOKEN_PROMPT = [686, 762, 18, 278, 271]  # the tiny model's ids of "Hello world, this"
# Chat's `echo` repeats the last message when it has the answer's role: a continued answer.
CONTINUED = [{"role": "user", "content": ENGLISH}, {"role": "assistant", "content": "Once upon a time"}]
OUT_OF_VOCABULARY = 999_999  # an id no tokenizer of a test model has: the engine's 400


def _echoes(prefix: str) -> Expect:
    return Expect(f"text starting with {prefix[:20]!r}", _all(lambda c: _text(c).startswith(prefix)))


def _echoes_only(prompt: str) -> Expect:
    return Expect("the prompt alone", _all(lambda c: _text(c) == prompt))


def _prompt_scored(choice: Mapping[str, Any]) -> bool:
    """Completions logprobs that start at the prompt: its first token has none."""
    logprobs = choice.get("logprobs") or {}
    values = logprobs.get("token_logprobs") or []
    return len(values) > 1 and values[0] is None and values[1] is not None


PROMPT_SCORED = Expect("logprobs of the prompt's tokens (the first null)", _all(_prompt_scored))
PROMPT_LOGPROBS = Expect("prompt_logprobs", _all(lambda c: bool(c.get("prompt_logprobs"))))
CHAT_PROMPT_LOGPROBS = Expect("prompt_logprobs", lambda a: bool(a.normalized.get("prompt_logprobs")))
BAD_REQUEST = Expect("a BadRequestError", lambda a: (a.normalized.get("error") or {}).get("type") == "BadRequestError")

SPECS: list[Spec] = [
    Spec("content", "chat", _constrained_chat(ENGLISH, 1, max_tokens=24), (HAS_CONTENT, _finish("length"))),
    Spec("content", "completions", _completion(ENGLISH, 2, max_tokens=24), (HAS_CONTENT, _finish("length"))),
    Spec("reasoning", "chat", _chat(ENGLISH, 143, max_tokens=12), (HAS_REASONING, NO_CONTENT)),
    Spec(
        "reasoning-content",
        "chat",
        _chat("Tell me a story.", 3, max_tokens=24, logit_bias={str(THINK_END_ID): 3.0}),
        (HAS_REASONING, HAS_CONTENT),
    ),
    Spec(
        "tool-auto",
        "chat",
        _tools(5, "Paris", tool_choice="auto"),
        (_tool_names(["get_weather"]), _finish("tool_calls")),
    ),
    Spec(
        "tool-named",
        "chat",
        _constrained_chat(
            "What is the weather?", 9, tools=[STRICT_WEATHER_TOOL], tool_choice=NAMED_TOOL, max_tokens=60
        ),
        (_tool_names(["get_weather"]),),
    ),
    Spec(  # a call cut short by max_tokens: `length`, not `tool_calls`, streamed or not
        "tool-required-cut",
        "chat",
        _constrained_chat("What is the weather?", 9, tools=[STRICT_WEATHER_TOOL], tool_choice="required", max_tokens=6),
        (_finish("length"),),
    ),
    Spec(
        "tool-several",
        "chat",
        _tools(7, "Paris", "東京 🗼"),
        (_tool_names(["get_weather", "get_weather"]), _finish("tool_calls")),
    ),
    Spec("tool-non-ascii", "chat", _tools(8, "東京 🗼"), (_tool_arguments({"city": "東京 🗼"}), _finish("tool_calls"))),
    Spec(
        "stop",
        "chat",
        _constrained_chat(ENGLISH, 9, max_tokens=40, stop=["e"], **_regex(LETTERS_REGEX)),
        (_finish("stop"), _stop_reason("e")),
    ),
    Spec(
        "stop",
        "completions",
        _constrained_completion(ENGLISH, 10, max_tokens=40, stop=["e"], **_regex(LETTERS_REGEX)),
        (_finish("stop"), _stop_reason("e")),
    ),
    Spec(
        "logprobs", "chat", _constrained_chat(ENGLISH, 11, max_tokens=12, logprobs=True, top_logprobs=2), (CHAT_TOP2,)
    ),
    Spec("logprobs", "completions", _completion(ENGLISH, 12, max_tokens=12, logprobs=2), (COMPLETION_TOP2,)),
    Spec(
        "logprobs-as-ids",
        "chat",
        _constrained_chat(CJK_EMOJI, 14, max_tokens=8, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True),
        (CHAT_TOP2, ID_TOKENS),
    ),
    Spec(
        "logprobs-as-ids",
        "completions",
        _completion(CJK_EMOJI, 15, max_tokens=8, logprobs=2, return_tokens_as_token_ids=True),
        (COMPLETION_TOP2, ID_TOKENS),
    ),
    Spec(
        "json",
        "chat",
        _constrained_chat("A city as JSON.", 27, max_tokens=60, structured_outputs={"json": CITY_SCHEMA}),
        (JSON_OBJECT, _finish("stop")),
    ),
    Spec(
        "json",
        "completions",
        _constrained_completion("A city as JSON:", 27, max_tokens=60, structured_outputs={"json": CITY_SCHEMA}),
        (JSON_OBJECT, _finish("stop")),
    ),
    Spec(
        "regex",
        "chat",
        _constrained_chat(ENGLISH, 15, max_tokens=40, **_regex(WORDS_REGEX)),
        (_matches(WORDS_REGEX), _finish("stop")),
    ),
    Spec(
        "regex",
        "completions",
        _constrained_completion(ENGLISH, 16, max_tokens=40, **_regex(WORDS_REGEX)),
        (_matches(WORDS_REGEX), _finish("stop")),
    ),
    Spec("n2", "chat", _constrained_chat(ENGLISH, 17, max_tokens=12, n=2), (TWO_CHOICES,), stream_usage=True),
    Spec("n2", "completions", _completion(ENGLISH, 18, max_tokens=12, n=2), (TWO_CHOICES,), stream_usage=True),
    Spec("usage", "chat", _chat(ENGLISH, 13, max_tokens=12), (ALL_REASONING_COUNTED,), stream_usage=True),
    Spec(
        "usage",
        "completions",
        _completion(ENGLISH, 20, max_tokens=16),
        (_usage_above("completion_tokens", 0), _usage_above("prompt_tokens", 0)),
        stream_usage=True,
    ),
    Spec(
        "default-max-tokens",
        "chat",
        _constrained_chat(ENGLISH, 21, **_regex(LONG_WORDS_REGEX)),
        (_usage_above("completion_tokens", 16), _finish("stop")),
        stream_usage=True,
    ),
    Spec(
        "default-max-tokens",
        "completions",
        _completion(ENGLISH, 22),
        (COMPLETION_TOKENS_16, _finish("length")),
        stream_usage=True,
    ),
    Spec(
        "cjk-emoji",
        "chat",
        _constrained_chat(CJK_EMOJI, 23, max_tokens=40, **_regex(RARE_CJK_EMOJI_REGEX)),
        (NON_ASCII, SPLIT_CHARS),
        stream_usage=True,
    ),
    Spec(
        "cjk-emoji",
        "completions",
        _constrained_completion(CJK_EMOJI, 24, max_tokens=40, **_regex(RARE_CJK_EMOJI_REGEX)),
        (NON_ASCII, SPLIT_CHARS),
        stream_usage=True,
    ),
    # echo and the prompt's logprobs
    Spec(
        "loglikelihood",
        "completions",
        _completion(LOGLIKELIHOOD, 40, echo=True, logprobs=1, max_tokens=0),
        (_echoes_only(LOGLIKELIHOOD), PROMPT_SCORED, COMPLETION_TOKENS_1),
        stream_usage=True,
    ),
    Spec(
        "loglikelihood-1",
        "completions",
        _completion(LOGLIKELIHOOD, 41, echo=True, logprobs=1, max_tokens=1),
        (_echoes(LOGLIKELIHOOD), PROMPT_SCORED),
    ),
    Spec(
        "echo-logprobs",
        "completions",
        _completion(CJK_EMOJI, 42, echo=True, logprobs=2, max_tokens=8),
        (_echoes(CJK_EMOJI), PROMPT_SCORED),
    ),
    Spec("echo", "completions", _completion(ENGLISH, 43, echo=True, max_tokens=8), (_echoes(ENGLISH),)),
    Spec(
        "echo-token-prompt",
        "completions",
        {"prompt": TOKEN_PROMPT, "seed": 44, **SAMPLING, "echo": True, "logprobs": 1, "max_tokens": 4},
        (PROMPT_SCORED,),
    ),
    Spec(
        "echo-batch",
        "completions",
        {"prompt": [ENGLISH, CJK_EMOJI], "seed": 45, **SAMPLING, "echo": True, "logprobs": 1, "max_tokens": 4},
        (PROMPT_SCORED, TWO_CHOICES),
        stream_usage=True,
    ),
    Spec(
        "prompt-logprobs",
        "completions",
        _completion(ENGLISH, 46, prompt_logprobs=2, max_tokens=4),
        (PROMPT_LOGPROBS,),
        streams=(False,),
    ),
    Spec(
        "prompt-logprobs-stream",
        "completions",
        _completion(ENGLISH, 46, prompt_logprobs=2, max_tokens=4),
        (BAD_REQUEST,),
        streams=(True,),
    ),
    Spec(
        "prompt-logprobs",
        "chat",
        _chat(ENGLISH, 47, prompt_logprobs=1, max_tokens=4),
        (CHAT_PROMPT_LOGPROBS,),
        streams=(False,),
    ),
    Spec(
        "echo",
        "chat",
        {
            "messages": CONTINUED,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "seed": 48,
            **SAMPLING,
            **NO_THINK,
            "echo": True,
            "logprobs": True,
            "top_logprobs": 2,
            "max_tokens": 8,
        },
        (_echoes("Once upon a time"), CHAT_TOP2),
    ),
    # in-band engine errors: a stream's error event, a whole answer's status and body
    Spec(
        "bad-logit-bias",
        "chat",
        _chat(ENGLISH, 49, max_tokens=4, logit_bias={str(OUT_OF_VOCABULARY): 1.0}),
        (BAD_REQUEST,),
    ),
    Spec(
        "bad-stop-token-ids",
        "completions",
        _completion(ENGLISH, 50, max_tokens=4, stop_token_ids=[OUT_OF_VOCABULARY]),
        (BAD_REQUEST,),
    ),
]
CASES: list[Case] = [case for spec in SPECS for case in spec.cases()]


# --------------------------------------------------------------------------- running


@dataclass
class CaseResult:
    name: str
    status: Status
    lines: list[str]

    def report(self) -> str:
        if self.status == "PASS":
            return f"PASS {self.name}"
        return f"{self.status} {self.name}: " + "; ".join(self.lines)


def posted(client: httpx.Client, base_url: str, path: str, body: Json) -> tuple[int, bytes] | Answer:
    """One request as a client sends it: status and raw body (streams read raw, to check their
    framing too), or the transport error as an unusable answer."""
    url = base_url.rstrip("/").removesuffix("/v1") + path  # `…/v1` as the SDKs take it
    try:
        with client.stream("POST", url, json=body) as response:
            return response.status_code, response.read()
    except httpx.HTTPError as error:
        return Answer(error=f"{type(error).__name__}: {error}")


def compared(name: str, gateway: Answer, native: Answer, max_reported: int) -> CaseResult:
    """The gateway's answer against native's, as one case's result."""
    if gateway.error:
        return CaseResult(name, "FAIL", [f"gateway: {gateway.error}"])
    lines = [f"gateway {p}" for p in gateway.problems] + differences(gateway.normalized, native.normalized)
    if len(lines) > max_reported:
        lines = lines[:max_reported] + [f"(+{len(lines) - max_reported} more)"]
    return CaseResult(name, "FAIL" if lines else "PASS", lines)


def fetch(client: httpx.Client, base_url: str, case: Case, model: str) -> Answer:
    answer = posted(client, base_url, PATHS[case.api], case.request(model))
    if isinstance(answer, Answer):
        return answer
    status, raw = answer
    if status != 200:
        return normalize_error(status, raw)
    if case.stream:
        return normalize_stream(case.api, raw)
    try:
        return normalize_full(case.api, json.loads(raw))
    except (json.JSONDecodeError, AttributeError) as error:
        return Answer(error=f"unparsable JSON answer ({error}): {raw[:120]!r}")


def unexercised(expect: Sequence[Expect], native: Answer) -> list[str]:
    """Why native's answer cannot judge the case (it must show the case's feature), if it cannot."""
    if native.error:
        return [f"native: {native.error}"]
    if native.problems:
        return [f"native {p}" for p in native.problems]
    return [f"native answer lacks {e.feature}" for e in expect if not e.holds(native)]


def native_then_gateway(
    name: str,
    expect: Sequence[Expect],
    fetch: Callable[[str], Answer],
    gateway_url: str,
    native_url: str,
    max_reported: int,
) -> CaseResult:
    """Native first (it must show the case's feature), then the gateway, then the comparison.
    The usage's cached tokens depend on the engine's prefix cache, which native's answer has
    just filled: when the answers differ, native is asked again, seeing the cache as the
    gateway's answer saw it, and the gateway's answer must equal that one."""
    native = fetch(native_url)
    broken = unexercised(expect, native)
    if broken:
        return CaseResult(name, "BROKEN CASE", broken)
    gateway = fetch(gateway_url)
    result = compared(name, gateway, native, max_reported)
    return result if result.status == "PASS" else compared(name, gateway, fetch(native_url), max_reported)


def run_case(
    case: Case,
    gateway_url: str,
    native_url: str,
    model: str,
    client: httpx.Client | None = None,
    max_reported: int = MAX_REPORTED,
) -> CaseResult:
    owned = client is None
    http = client or new_client()
    try:
        fetched = partial(fetch, http, case=case, model=model)
        return native_then_gateway(case.name, case.spec.expect, fetched, gateway_url, native_url, max_reported)
    finally:
        if owned:
            http.close()


def new_client(timeout: float = 120) -> httpx.Client:
    """No proxies from the environment: both endpoints are addressed directly."""
    return httpx.Client(timeout=timeout, trust_env=False)


def select(only: str | None) -> list[Case]:
    return [c for c in CASES if not only or only in c.name]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gateway", required=True, help="gateway base URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--native", required=True, help="the engine's own OpenAI base URL, e.g. http://127.0.0.1:8200")
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--only", help="run only the cases whose name contains this")
    parser.add_argument("--max-differences", type=int, default=MAX_REPORTED, help="differences shown per case")
    parser.add_argument(
        "--api",
        choices=("openai", "messages", "responses", "all"),
        default="all",
        help="OpenAI chat/completions, Anthropic Messages, OpenAI Responses",
    )


def run(args: argparse.Namespace) -> int:
    from ext_proc.tools import messages_conformance as messages
    from ext_proc.tools import responses_conformance as responses

    runs: list[Callable[..., CaseResult]] = []
    if args.api in ("openai", "all"):
        runs += [
            partial(run_case, c, args.gateway, args.native, args.model, max_reported=args.max_differences)
            for c in select(args.only)
        ]
    if args.api in ("messages", "all"):
        chosen = [c for c in messages.CASES if not args.only or args.only in c.name]
        runs += [
            partial(messages.run_case, c, args.gateway, args.native, args.model, max_reported=args.max_differences)
            for c in chosen
        ]
    if args.api in ("responses", "all"):
        picked = [c for c in responses.CASES if not args.only or args.only in c.name]
        runs += [
            partial(responses.run_case, c, args.gateway, args.native, args.model, max_reported=args.max_differences)
            for c in picked
        ]
    if not runs:
        print(f"no case matches {args.only!r}", file=sys.stderr)
        return 2
    failed = 0
    with new_client() as client:
        for run in runs:
            result = run(client=client)
            failed += result.status != "PASS"
            print(result.report(), flush=True)
    print(f"{len(runs) - failed}/{len(runs)} cases pass", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tito conformance", description="the gateway's OpenAI answers vs the engine's native ones"
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
