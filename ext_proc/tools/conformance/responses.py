"""Conformance of OpenAI Responses: the gateway's `/v1/responses` answer must equal the
engine's own `/v1/responses` answer (`tito conformance --api responses`).

As for Messages (`messages.py`), each case runs first against the engine, whose
answer must show the case's feature, then against the gateway. Random values are normalized
away (response, item and call ids: present; `created_at`). Compared: the response's status,
model, echoed parameters, every output item (message text, reasoning text, function name and
arguments as parsed JSON), output logprobs, the usage (with the engine's prefix-cache counts:
engines run with `--enable-prompt-tokens-details`, which generate needs to report them); for
streams also the sequence of event types (a run of deltas counted once: how many tokens a
delta carries is not the promise), with the framing a client relies on (`event:` naming each `data:`'s type,
`sequence_number` counting from 0, `response.created` first, `response.completed` last, no
`[DONE]`). Errors are compared by status and body.

Every case samples greedily (temperature 0) but two seeded logprobs cases; tool calls are
forced with a hermes regex, as in the chat cases.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
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
from ext_proc.tools.conformance.openai_cases import (
    CITY_SCHEMA,
    ENGLISH,
    LETTERS_REGEX,
    NO_THINK,
    hermes_tool_call_regex,
)

PATH = "/v1/responses"
ECHOED = ("object", "model", "status", "incomplete_details", "instructions", "max_output_tokens", "temperature")
ECHOED_TOO = ("top_p", "tool_choice", "tools", "text", "parallel_tool_calls", "truncation", "error")


def _item(item: Mapping[str, Any]) -> Json:
    kind = item.get("type")
    out: Json = {"type": kind, "id": present(item.get("id")), "status": item.get("status")}
    if kind == "message":
        out["role"] = item.get("role")
        out["content"] = [{k: part.get(k) for k in ("type", "text", "logprobs")} for part in item.get("content") or []]
    elif kind == "reasoning":
        out["content"] = [part.get("text") for part in item.get("content") or []]
        out["summary"] = [part.get("text") for part in item.get("summary") or []]
    elif kind == "function_call":
        out["name"] = item.get("name")
        out["call_id"] = present(item.get("call_id"))
        try:
            out["arguments"] = json.loads(str(item.get("arguments")))
        except json.JSONDecodeError:
            out["arguments"] = {"<invalid JSON>": item.get("arguments")}
    return out


def normalize_response(body: Mapping[str, Any]) -> Answer:
    """A whole Responses answer (or the one `response.completed` carries)."""
    normalized = {key: body.get(key) for key in (*ECHOED, *ECHOED_TOO)}
    normalized["id"] = present(body.get("id"))
    normalized["output"] = [_item(item) for item in body.get("output") or []]
    normalized["usage"] = body.get("usage")
    return Answer(normalized)


def _event_key(data: Mapping[str, Any]) -> str:
    kind = str(data.get("type"))
    if "output_index" in data:
        kind += f"[{data['output_index']}]"
    if "content_index" in data:
        kind += f"[{data['content_index']}]"
    return kind


def normalize_stream(raw: bytes) -> Answer:
    stream = TypedStream.read(raw, "Responses", "response.created", "response.completed", _event_key)
    numbers = [data.get("sequence_number") for _, data in stream.events]
    if numbers != list(range(len(stream.events))):
        stream.problems.append(f"stream: sequence numbers {numbers[:12]} are not 0, 1, 2, ...")
    text: dict[str, str] = {}
    final: Answer | None = None
    error = None
    for _, data in stream.events:
        kind = data.get("type")
        if str(kind).endswith(".delta"):  # what a client accumulates, per item and part
            slot = f"{kind}[{data.get('output_index')}][{data.get('content_index')}]"
            text[slot] = text.get(slot, "") + str(data.get("delta"))
        elif kind == "response.completed":
            final = normalize_response(data.get("response") or {})
        elif kind == "error":
            error = {k: data.get(k) for k in ("code", "message", "param")}
    normalized = dict(final.normalized) if final is not None else {}
    normalized.update(events=stream.sequence, deltas=text)
    return stream.answer(normalized, error)


# --------------------------------------------------------------------------- cases


class ResponsesCase(BodyCase):
    """A Responses case (one body to `PATH`, whole or streamed)."""


def _has_item(kind: str) -> Expect:
    return Expect(f"a {kind} item", lambda a: any(i["type"] == kind for i in a.normalized.get("output") or []))


def _calls(n: int) -> Expect:
    return Expect(
        f"{n} function calls",
        lambda a: sum(i["type"] == "function_call" for i in a.normalized.get("output") or []) == n,
    )


TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CITY_FORMAT = {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA}
GREEDY = {"temperature": 0.0}
HISTORY: list[Json] = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
]
HAS_TEXT = _has_item("message")
HAS_REASONING = _has_item("reasoning")
LOGPROBS = "message.output_text.logprobs"
HAS_LOGPROBS = Expect(
    "output text logprobs",
    lambda a: any(
        part.get("logprobs")
        for item in a.normalized.get("output") or []
        if item["type"] == "message"
        for part in item["content"]
    ),
)


def _ask(user: str | list[Json], max_output_tokens: int, **extra: Any) -> Json:
    return {"input": user, "max_output_tokens": max_output_tokens, **GREEDY, **extra}


def _forced(*cities: str, **extra: Any) -> Json:
    """Tool calls a random-weight model emits on demand: hermes blocks forced by a regex."""
    regex = {"structured_outputs": {"regex": hermes_tool_call_regex(*cities)}}
    return _ask("What is the weather?", 120, tools=[TOOL], **regex, **NO_THINK, **extra)


SPECS: list[tuple[str, Json, tuple[Expect, ...]]] = [
    ("text", _ask(ENGLISH, 12, **NO_THINK), (HAS_TEXT, normalized_is("status", "incomplete"))),
    ("thinking", _ask(ENGLISH, 12), (HAS_REASONING,)),
    ("instructions", _ask(ENGLISH, 8, instructions="You are terse.", **NO_THINK), (HAS_TEXT,)),
    (
        "system-message",
        _ask([{"role": "system", "content": "Answer in French."}, {"role": "user", "content": ENGLISH}], 8, **NO_THINK),
        (HAS_TEXT,),
    ),
    (
        "system-blocks",
        _ask(
            [
                {"role": "system", "content": [{"type": "input_text", "text": "You are terse."}]},
                {"role": "user", "content": [{"type": "input_text", "text": ENGLISH}]},
            ],
            8,
            **NO_THINK,
        ),
        (HAS_TEXT,),
    ),
    ("json-format", _ask(ENGLISH, 40, text={"format": CITY_FORMAT}, **NO_THINK), (HAS_TEXT,)),
    # the stop string ends inside the letters a regex forces
    (
        "stop",
        _ask(ENGLISH, 40, stop=["e"], structured_outputs={"regex": LETTERS_REGEX}, **NO_THINK),
        (HAS_TEXT, normalized_is("status", "completed")),
    ),
    ("tool-call", _forced("Paris"), (_calls(1),)),
    ("tool-calls", _forced("Paris", "東京 🗼"), (_calls(2),)),
    # (required and named calls are constrained by vLLM's own tool grammar, not the regex)
    ("tool-required", _forced("Paris", tool_choice="required"), ()),
    ("tool-named", _forced("Paris", tool_choice={"type": "function", "name": "get_weather"}), ()),
    ("tool-none", _ask(ENGLISH, 10, tools=[TOOL], tool_choice="none", **NO_THINK), (HAS_TEXT,)),
    # a stock engine has no tool server: built-in tools are listed, not rendered, not run
    ("built-in-tools", _ask(ENGLISH, 8, tools=[{"type": "web_search_preview"}], **NO_THINK), ()),
    ("tool-result", _ask(HISTORY, 10, tools=[TOOL], **NO_THINK), ()),
    ("logprobs", _ask(ENGLISH, 12, include=[LOGPROBS], **NO_THINK), (HAS_LOGPROBS,)),
    ("top-logprobs", _ask(ENGLISH, 12, include=[LOGPROBS], top_logprobs=3, **NO_THINK), (HAS_LOGPROBS,)),
    # sampled (seeded): the sampled token is often outside the top 5, and candidates decode
    # alike (""); 5 tokens that each show text, as a stream natively drops the logprobs of a
    # step without text unless its engine merged that step into the next (timing)
    (
        "top-logprobs-sampled",
        _ask(ENGLISH, 5, include=[LOGPROBS], top_logprobs=5, **NO_THINK, temperature=1.0, seed=7),
        (HAS_LOGPROBS,),
    ),
]
CASES: list[ResponsesCase] = in_both_modes(ResponsesCase, "responses", SPECS) + [
    # with reasoning, native puts every output token's logprobs on the message (sampled: greedy
    # never ends the reasoning); whole only: a stream shows those of content steps, and of
    # reasoning steps its engine happened to merge into them
    ResponsesCase(
        "responses-thinking-logprobs-full",
        _ask(ENGLISH, 16, include=[LOGPROBS], top_logprobs=2, temperature=1.0, seed=1),
        (HAS_REASONING, HAS_LOGPROBS),
    ),
    ResponsesCase("responses-error-no-input", {"max_output_tokens": 4}, (http_status(400),)),
    ResponsesCase("responses-error-tool-choice-no-tools", _ask("hi", 4, tool_choice="required"), (http_status(400),)),
    ResponsesCase(
        "responses-error-tool-choice-unknown",
        _ask("hi", 4, tools=[TOOL], tool_choice={"type": "function", "name": "nope"}),
        (http_status(400),),
    ),
    ResponsesCase("responses-error-unknown-model", {**_ask("hi", 4), "model": "no-such-model"}, (http_status(404),)),
    ResponsesCase("responses-error-too-long", _ask("hi " * 5000, 4), (http_status(400),)),
    ResponsesCase("responses-error-too-long-stream", _ask("hi " * 5000, 4), (http_status(400),), stream=True),
    ResponsesCase("responses-error-previous", _ask("hi", 4, previous_response_id="resp_1"), (http_status(404),)),
]


# --------------------------------------------------------------------------- running


def fetch(client: httpx.Client, base_url: str, case: ResponsesCase, model: str) -> Answer:
    answer = posted(client, base_url, PATH, case.request(model))
    return answer_of(answer, case.stream, normalize_body_error, normalize_stream, normalize_response)


run_case = partial(run_with, fetch)
