"""What every API's conformance cases share: an answer reduced to what a client relies on,
the field-by-field comparison, and the runner (native first, which must show the case's
feature, then the gateway); and what the two APIs whose streams are typed events (Messages,
Responses) share: the stream's reading and framing checks, and the case shape (one body, run
whole and streamed). Each API's cases and normalization are a module of their own
(`openai.py` with `openai_cases.py` and `openai_expects.py`, `messages.py`, `responses.py`);
`cli.py` is the command."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, TypeVar

import httpx

Status = Literal["PASS", "FAIL", "BROKEN CASE"]
Json = dict[str, Any]

C = TypeVar("C", bound="BodyCase")

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


def normalize_body_error(status: int, raw: bytes) -> Answer:
    try:
        body = json.loads(raw)
    except json.JSONDecodeError:
        return Answer(error=f"HTTP {status} {raw[:200].decode(errors='replace')}")
    return Answer({"status": status, "body": body})


def split_events(raw: bytes) -> tuple[list[tuple[str | None, Json]], list[str]]:
    """(event name, data) pairs of an SSE body, plus framing problems."""
    text = raw.decode("utf-8", errors="replace").replace("\r\n", "\n")
    events: list[tuple[str | None, Json]] = []
    problems: list[str] = []
    for block in text.split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
            elif line and not line.startswith(":"):
                problems.append(f"non-SSE line {line[:60]!r}")
        if not data:
            continue
        try:
            parsed = json.loads("\n".join(data))
        except json.JSONDecodeError:
            problems.append(f"unparsable event {data[0][:60]!r}")
            continue
        if name != parsed.get("type"):
            problems.append(f"event {name!r} carries a {parsed.get('type')!r}")
        events.append((name, parsed))
    return events, problems


def present(value: Any) -> str:
    """A random value (an id, a signature) normalized to whether it is there."""
    return "present" if value else "missing"


@dataclass
class TypedStream:
    """An SSE stream whose events are named for their `type` (Messages, Responses), as a
    client reads it: the events, the framing problems (`first` must open it, `last` end it
    unless an error event came, no `[DONE]`) and the sequence of event keys, a run of one
    key counted once (how many tokens a delta carries is not the promise)."""

    events: list[tuple[str | None, Json]]
    problems: list[str]
    sequence: list[str]
    last: str

    @classmethod
    def read(cls, raw: bytes, api: str, first: str, last: str, key: Callable[[Json], str]) -> TypedStream:
        events, problems = split_events(raw)
        if not events or events[0][0] != first:
            problems.append(f"stream: the first event is not {first}")
        if b"[DONE]" in raw:
            problems.append(f"stream: a [DONE] in a {api} stream")
        sequence: list[str] = []
        for _, data in events:
            event_key = key(data)
            if not sequence or sequence[-1] != event_key:
                sequence.append(event_key)
        return cls(events, problems, sequence, last)

    def answer(self, normalized: Json, error: Any) -> Answer:
        """The stream's answer: what the API's normalizer made of it, with the error event's
        error if one came (else the stream must end with `last`)."""
        if error is None and (not self.events or self.events[-1][0] != self.last):
            self.problems.append(f"stream: the last event is not {self.last}")
        if error is not None:
            normalized["error"] = error
        return Answer(normalized, self.problems)


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


# --------------------------------------------------------------------------- running


@dataclass(frozen=True)
class Expect:
    """What the native answer must show for the case to exercise its feature."""

    feature: str
    holds: Callable[[Answer], bool]


def http_status(status: int) -> Expect:
    """An error case's feature: native answers with this status."""
    return Expect(f"HTTP {status}", lambda a: a.normalized.get("status") == status)


def normalized_is(key: str, value: Any) -> Expect:
    """Native's normalized answer has `value` under `key` (a stop reason, a status)."""
    return Expect(f"{key} {value!r}", lambda a: a.normalized.get(key) == value)


@dataclass(frozen=True)
class BodyCase:
    """A case of an API whose request is one JSON body (Messages, Responses)."""

    name: str
    body: Mapping[str, Any]  # without model and stream
    expect: tuple[Expect, ...] = ()
    stream: bool = False

    def request(self, model: str) -> Json:
        return {"model": model, **self.body, "stream": self.stream}  # a case naming its own model keeps it


def in_both_modes(
    kind: Callable[..., C], prefix: str, specs: Sequence[tuple[str, Json, tuple[Expect, ...]]]
) -> list[C]:
    """Each spec (name, body, expect) as a whole case and a streamed one: `prefix-name-full`,
    `prefix-name-stream`."""
    return [
        kind(f"{prefix}-{name}-{'stream' if stream else 'full'}", body, expect, stream)
        for name, body, expect in specs
        for stream in (False, True)
    ]


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
    When the answers differ, native is asked again, and the gateway's answer must equal that
    one: the usage's cached tokens depend on the engine's prefix cache, which native's first
    answer has just filled; and a loaded native API server may hand its parsers several
    engine steps at once, which can split a stream's reasoning and content otherwise
    (vllm#41691; the gateway parses one token per step, as unloaded native does)."""
    native = fetch(native_url)
    broken = unexercised(expect, native)
    if broken:
        return CaseResult(name, "BROKEN CASE", broken)
    gateway = fetch(gateway_url)
    result = compared(name, gateway, native, max_reported)
    return result if result.status == "PASS" else compared(name, gateway, fetch(native_url), max_reported)


def new_client(timeout: float = 120) -> httpx.Client:
    """No proxies from the environment: both endpoints are addressed directly."""
    return httpx.Client(timeout=timeout, trust_env=False)


def answer_of(
    answer: tuple[int, bytes] | Answer,
    stream: bool,
    error: Callable[[int, bytes], Answer],
    streamed: Callable[[bytes], Answer],
    whole: Callable[[Any], Answer],
) -> Answer:
    """A posted request's answer as compared: an error by status and body, a stream or a
    whole body normalized by the API's own rules."""
    if isinstance(answer, Answer):
        return answer
    status, raw = answer
    if status != 200:
        return error(status, raw)
    if stream:
        return streamed(raw)
    try:
        return whole(json.loads(raw))
    except (json.JSONDecodeError, AttributeError) as problem:
        return Answer(error=f"unparsable JSON answer ({problem}): {raw[:120]!r}")


def run_with(
    fetch: Callable[..., Answer],
    case: Any,
    gateway_url: str,
    native_url: str,
    model: str,
    client: httpx.Client,
    max_reported: int = MAX_REPORTED,
) -> CaseResult:
    """One case (with `name` and `expect`) of an API whose `fetch(client, url, case=, model=)`
    posts and normalizes it."""
    fetched = partial(fetch, client, case=case, model=model)
    return native_then_gateway(case.name, case.expect, fetched, gateway_url, native_url, max_reported)
