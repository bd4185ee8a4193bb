"""OpenAI answers (chat and completions) as conformance compares them: whole or streamed,
normalized per choice (streams concatenated, tool-call ids reduced to "present and stable",
ids and timestamps dropped), their SSE framing checked, errors by status and error object;
and the OpenAI cases run against both endpoints."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx

from ext_proc.tools.conformance.core import (
    MAX_REPORTED,
    Answer,
    CaseResult,
    Json,
    answer_of,
    native_then_gateway,
    new_client,
    posted,
)
from ext_proc.tools.conformance.openai_cases import CASES, Api, Case

PATHS: dict[Api, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
CHUNK_OBJECT: dict[Api, str] = {"chat": "chat.completion.chunk", "completions": "text_completion"}


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
        "system_fingerprint": body.get("system_fingerprint"),
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
        # one per choice's last chunk, or on the usage chunk alone
        "system_fingerprint": [c["system_fingerprint"] for c in data if "system_fingerprint" in c],
    }
    if api == "chat":
        normalized["prompt_logprobs"] = None  # never streamed
    errors = [c["error"] for c in chunks if "error" in c]
    if errors:
        normalized["error"] = _error(errors[0])
    return Answer(normalized, problems)


def fetch(client: httpx.Client, base_url: str, case: Case, model: str) -> Answer:
    answer = posted(client, base_url, PATHS[case.api], case.request(model))
    return answer_of(
        answer, case.stream, normalize_error, partial(normalize_stream, case.api), partial(normalize_full, case.api)
    )


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


def select(only: str | None) -> list[Case]:
    return [c for c in CASES if not only or only in c.name]
