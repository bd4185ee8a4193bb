"""What a native OpenAI answer must show for a conformance case (`openai_cases.py`) to prove
anything: the `Expect`s of the chat and completions cases (finish and stop reasons, content,
reasoning, tool calls, logprobs, usage, echo, in-band errors) and the small predicates they
are built from. Kept apart from the cases, which are the requests: a case names what it
expects from here, and the checks read only the normalized answer (`core.Answer`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ext_proc.tools.conformance.core import Answer, Expect, Json


def _text(choice: Mapping[str, Any]) -> str:
    """The generated visible text of a choice, whatever the API."""
    return str(choice.get("content") or choice.get("text") or "")


def _all(test: Callable[[Json], bool]) -> Callable[[Answer], bool]:
    return lambda a: bool(a.choices) and all(test(c) for c in a.choices)


def finish(reason: str) -> Expect:
    return Expect(f"finish_reason {reason!r}", _all(lambda c: c["finish_reason"] == reason))


def tool_names(names: Sequence[str]) -> Expect:
    return Expect(f"tool calls {list(names)}", _all(lambda c: [t["name"] for t in c["tool_calls"]] == list(names)))


def usage_above(field_name: str, minimum: int) -> Expect:
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


def matches(regex: str) -> Expect:
    return Expect(f"text matching {regex!r}", _all(lambda c: re.fullmatch(regex, _text(c)) is not None))


def stop_reason(value: str) -> Expect:
    return Expect(f"stop_reason {value!r}", _all(lambda c: c["stop_reason"] == value))


def tool_arguments(arguments: Json) -> Expect:
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
CHAT_NO_TOP = Expect(
    "logprobs with no top_logprobs",
    _all(lambda c: bool(c.get("logprobs")) and all(not e["top_logprobs"] for e in c["logprobs"])),
)
ID_TOKENS = Expect("logprob tokens as token ids", _all(_id_tokens))
COMPLETION_TOP2 = Expect("logprobs with 2 top_logprobs", _all(_completion_top2))
JSON_OBJECT = Expect("a JSON object", _all(_json_content))


def echoes(prefix: str) -> Expect:
    return Expect(f"text starting with {prefix[:20]!r}", _all(lambda c: _text(c).startswith(prefix)))


def echoes_only(prompt: str) -> Expect:
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
