"""Where vLLM 0.32's sidecar `/derender` differs from native serving, corrected with the
gateway's own tokenizer and request (`sidecar.py` applies these): stop tokens and stop strings
it leaves in, the prompt-cache details of usage, the logprob candidates each API shows, and a
whole tool-call answer's `finish_reason`."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from ext_proc.derender.logprobs import trim_chat_candidates, trim_completion_candidates
from ext_proc.derender.model import DerenderModel, cached_tokens
from ext_proc.protocol import Pipeline, TokenizedRequest


def drop_stop_token(generate: dict[str, Any], keep_one: bool = False) -> bool:
    """Native serving never detokenizes the EOS or stop-token id that ended generation (the
    engine's detokenizer skips it); vLLM 0.32's derender does, and with a parser configured
    (special tokens kept) `<|im_end|>` would reach the client. Removes it in place."""
    dropped = False
    for choice in generate.get("choices") or []:
        ids = choice.get("token_ids") or []
        stop_reason = choice.get("stop_reason")
        if choice.get("finish_reason") == "stop" and not isinstance(stop_reason, str) and len(ids) > keep_one:
            choice["token_ids"] = ids[:-1]
            dropped = True
    return dropped


def stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if body.get("include_stop_str_in_output") or not stop:
        return []
    return [stop] if isinstance(stop, str) else [s for s in stop if isinstance(s, str) and s]


def stop_cuts(request: TokenizedRequest, n: int) -> list[StopCut | None]:
    stops = stop_strings(request.request.body)
    return [StopCut(stops) if stops else None for _ in range(n)]


TEXT_FIELDS = ("reasoning", "content", "text")


def cut_fields(holder: dict[str, Any], stop: StopCut, final: bool) -> None:
    """Applies `stop` to a delta/message/completion choice's text fields, in text order."""
    pieces = [(f, holder[f]) for f in TEXT_FIELDS if isinstance(holder.get(f), str) and holder[f]]
    kept: dict[str, str] = {}
    for field, text in stop.feed(pieces, final):
        kept[field] = kept.get(field, "") + text
    for field in TEXT_FIELDS:
        if isinstance(holder.get(field), str):
            holder[field] = kept.get(field, "" if field == "text" else None)


def prompt_details(model: DerenderModel, usage: Any, api: Pipeline, generate_usage: Any, whole: bool) -> None:
    """The engine's cached tokens as native's `prompt_tokens_details` (derender drops them),
    in native's place: before the completion's details."""
    cached = cached_tokens(generate_usage)
    if cached is None or not isinstance(usage, dict):
        return
    completion = usage.pop("completion_tokens_details", None)
    details = model.prompt_details(api is Pipeline.CHAT, int(usage["prompt_tokens"]), cached, whole)
    usage["prompt_tokens_details"] = details
    if completion is not None or whole:
        usage["completion_tokens_details"] = completion


class StopCut:
    """Stop strings as the engine's detokenizer applies them, on text the sidecar already
    derendered: text that could begin a stop string is held back, and the text from a stop
    string on is never sent. vLLM 0.32's derender does neither."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = stops
        self._hold = max(len(s) for s in stops) - 1
        self._pending: list[tuple[str, str]] = []  # (field, text) not sent yet
        self._stopped = False

    def feed(self, pieces: list[tuple[str, str]], final: bool) -> list[tuple[str, str]]:
        if self._stopped:
            return []
        self._pending += pieces
        text = "".join(t for _, t in self._pending)
        found = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if found:
            self._stopped = True
            return self._take(min(found), drop_rest=True)
        return self._take(len(text) if final else max(len(text) - self._hold, 0))

    def _take(self, n: int, drop_rest: bool = False) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while self._pending and n > 0:
            field, text = self._pending.pop(0)
            if len(text) > n:
                self._pending.insert(0, (field, text[n:]))
                text = text[:n]
            if out and out[-1][0] == field:
                out[-1] = (field, out[-1][1] + text)
            else:
                out.append((field, text))
            n -= len(text)
        if drop_rest:
            self._pending = []
        return out


def without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    return value


def shown_candidates(request: TokenizedRequest) -> Callable[[dict[str, Any]], None] | None:
    """What keeps, of generate's candidates, those the client is shown (vLLM's `/derender`
    shows every candidate it gets), when the client asked for logprobs."""
    body = request.request.body
    top = body.get("logprobs")
    if request.api is Pipeline.COMPLETIONS:
        return partial(trim_completion_candidates, top=top) if isinstance(top, int) and top >= 0 else None
    return partial(trim_chat_candidates, top=body.get("top_logprobs")) if top else None


def tool_calls_finish_reason(result: dict[str, Any], body: dict[str, Any]) -> None:
    """Native serving reports `tool_calls` when the answer called tools (auto or required);
    vLLM 0.32's derender passes the engine's `stop` through."""
    tool_choice = body.get("tool_choice")
    if isinstance(tool_choice, dict):  # a named function: native keeps the engine's reason
        return
    for choice in result.get("choices") or []:
        message = choice.get("message") or {}
        called = bool(message.get("tool_calls"))
        if (called and tool_choice in (None, "auto")) or (
            tool_choice == "required" and choice.get("finish_reason") == "stop"
        ):
            choice["finish_reason"] = "tool_calls"
