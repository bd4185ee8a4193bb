"""One prompt's live derender state, shared by the chat and completions streams: per choice the
engine's incremental detokenizer and one parser, fed only each step's new ids (O(new ids) per
event), and consecutive plain-text chunks of one choice merged into one."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from ext_proc.derender.logprobs import detokenized
from ext_proc.derender.model import DerenderModel, cached_tokens, fingerprinted
from ext_proc.derender.streaming import sse_event
from ext_proc.protocol import PromptTokens, TokenizedRequest


@dataclass(frozen=True)
class Step:
    """One choice's new output in one engine event: one parser step, as natively."""

    index: int
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: Any
    logprobs: dict[str, Any] | None
    text: str | None = None  # decoded whole already (beam search's answer, as native decodes it)


@dataclass
class Choice:
    """One choice's live state: detokenizer window, parser, counters. Grows only with the
    output itself (the detokenizer's text, the parser's text, the ids for reasoning counts)."""

    detokenizer: Any
    parser: Any
    num_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    tools_streamed: bool = False
    finished: bool = False
    logprob_context: list[int] = field(default_factory=list)
    text_offset: int = 0  # completions: where the next logprob token starts
    prompt_shown: bool = False  # completions: the prompt (echo) or its ids went out

    def text(self, step: Step) -> str:
        if step.text is not None:
            return step.text
        # EOS and stop ids end generation in the engine core and are not detokenized;
        # a stop *string* is found (and cut) by the detokenizer itself.
        stop_terminated = step.finish_reason == "stop" and not isinstance(step.stop_reason, str)
        self.detokenizer.update(step.token_ids, stop_terminated)
        return str(self.detokenizer.get_next_output_text(step.finish_reason is not None, True))


def event_steps(event: dict[str, Any]) -> list[Step]:
    return [
        Step(
            int(c.get("index", 0)),
            list(c.get("token_ids") or []),
            c.get("finish_reason"),
            c.get("stop_reason"),
            c.get("logprobs"),
            c.get("text"),
        )
        for c in event.get("choices") or []
    ]


class Session:
    """Shared by the chat and completions sessions: the request, its choices, usage."""

    _object = ""  # the chunks' `object`

    def __init__(self, model: DerenderModel, request: TokenizedRequest, prompt_index: int, client: Any) -> None:
        self._model = model
        self._request = request
        self._prompt = request.prompts[prompt_index]
        self._client = client
        self._params = self._prompt.sampling_params
        self._n = int(client.n or 1)
        self._created = int(time.time())
        self._choices: dict[int, Choice] = {}
        self._started = False
        usage = client.stream_options
        self._include_usage = bool(usage and usage.include_usage)
        self._continuous_usage = self._include_usage and bool(usage.continuous_usage_stats)
        self._prompt_logprobs: list[Any] | None = None  # a whole answer's (the only ones that carry them)
        self.cached_tokens: int | None = None  # the engine's prefix-cache hits, when it reports them
        self._fingerprint = model.system_fingerprint()  # the engines' as the stream starts
        # An answer made per step keeps its steps apart: its API parses each one
        self._steps_apart = request.request.per_step

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self._choices.values())

    def _choice(self, index: int, parser: bool) -> Choice:
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = Choice(
                self._model.detokenizer(self._prompt, self._params),
                self._model.parser(self._client) if parser else None,
            )
        return choice

    def _logprob_positions(self, choice: Choice, step: Step) -> list[Any]:
        return self._model.logprobs.positions(step.logprobs, choice.logprob_context, detokenized(self._params))

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self._request.request_id,
            "object": self._object,
            "created": self._created,
            "model": self._request.request.response_model(self._model.served_name),
            "choices": choices,
            **extra,
        }

    def steps(self, events: list[dict[str, Any]]) -> bytes:
        """Events that arrived together: each is one parser step, exactly as the engine sent
        it (so parser state and usage match native serving), and consecutive plain-text
        chunks of one choice go out as one chunk."""
        chunks: list[dict[str, Any]] = []
        for event in events:
            for chunk in self._event(event):
                merged = merge(chunks[-1], chunk) if chunks and not self._steps_apart else None
                if merged is None:
                    chunks.append(chunk)
                else:
                    chunks[-1] = merged
        return b"".join(sse_event(orjson.dumps(chunk)) for chunk in chunks)

    def _event(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        if event.get("prompt_logprobs") is not None:
            self._prompt_logprobs = event["prompt_logprobs"]
        out = self._prelude()
        fingerprint = self._fingerprint
        for step in event_steps(event):
            chunk = self._step(step)
            if chunk is not None:
                # native stamps the last message: a choice's last chunk, unless usage follows
                last = step.finish_reason is not None and not self._include_usage
                out.append(fingerprinted(chunk, fingerprint) if last else chunk)
        if event.get("usage") is not None and not event.get("choices"):
            self.cached_tokens = cached_tokens(event["usage"])
            if self._include_usage:
                out.append(fingerprinted(self._usage_chunk(), fingerprint))
        return out

    def _prelude(self) -> list[dict[str, Any]]:
        """Chunks due before the first event's own (none, unless a subclass says so)."""
        return []

    def _step(self, step: Step) -> dict[str, Any] | None:
        raise NotImplementedError

    def _usage_chunk(self) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def _prompt_tokens(self) -> int:
        return len(self._prompt.token_ids)


TEXT_KEYS = frozenset({"content", "reasoning", "text"})


PER_TOKEN_KEYS = ("logprobs", "token_ids")


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """Two chunks of one choice as one, when only text (content, reasoning, completion text)
    and per-token lists (logprobs, token ids) are in them; None otherwise (tool calls, role,
    finish, usage and prompt ids always keep their own chunk)."""
    if a.keys() != b.keys() or "usage" in a or len(a["choices"]) != 1 or len(b["choices"]) != 1:
        return None
    x, y = a["choices"][0], b["choices"][0]
    if x["index"] != y["index"] or x.get("finish_reason") or y.get("finish_reason") or x.get("prompt_token_ids"):
        return None
    if any((x.get(key) is None) != (y.get(key) is None) for key in PER_TOKEN_KEYS):
        return None  # (chat's echoed message has no logprobs; the first output's do)
    if "delta" in x:
        dx, dy = x["delta"], y["delta"]
        if dx.keys() != dy.keys() or not dx.keys() <= TEXT_KEYS or not all(isinstance(dx[k], str) for k in dx):
            return None
        merged = {**x, "delta": {k: dx[k] + dy[k] for k in dx}}
    else:
        merged = {**x, "text": x["text"] + y["text"]}
    for key in ("token_ids",):
        if x.get(key) is not None:
            merged[key] = x[key] + y[key]
    if x.get("logprobs") is not None:
        merged["logprobs"] = {k: v + y["logprobs"][k] for k, v in x["logprobs"].items()}
    return {**a, "choices": [merged]}


def delta_fields(delta: Any) -> dict[str, Any] | None:
    if delta is None:
        return None
    data: dict[str, Any] = delta.model_dump(exclude_unset=True)
    return data


def final_text(model: DerenderModel, prompt: PromptTokens, params: dict[str, Any], choice: dict[str, Any]) -> str:
    """A whole answer's choice as text: the detokenizer over all its ids (or its text as given)."""
    if choice.get("text") is not None:
        return str(choice["text"])
    detokenizer = model.detokenizer(prompt, params)
    state = Choice(detokenizer, None)
    state.text(
        Step(0, list(choice.get("token_ids") or []), choice.get("finish_reason"), choice.get("stop_reason"), None)
    )
    return str(detokenizer.get_next_output_text(True, False))
