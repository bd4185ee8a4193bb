"""Logprobs: generate's integer-id `GenerateLogProbs` -> the OpenAI shapes native vLLM serves.

Native serving decodes each position's ids on the engine (`LogprobsProcessor`: one
`convert_ids_list_to_tokens` per position, U+FFFD repaired with the last four sampled ids as
context) into `dict[id, Logprob]`, sampled id first; chat keeps the first `top_logprobs`
entries of that dict, completions the first `logprobs + 1`. Both derender modes use this
module, so their logprobs are the engine's, byte for byte, in the engine's order: nothing
here sorts or ranks candidates (tied logprobs are common, and their order is the engine's
`topk`'s, see `token_only.engine_logprobs`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

NAN_LOGPROB = -9999.0
CONTEXT_WINDOW = 4  # enough preceding ids to complete any UTF-8 sequence


@dataclass(frozen=True)
class Candidate:
    token_id: int
    logprob: float
    text: str  # decoded as the engine decodes logprob tokens
    rank: int | None


@dataclass(frozen=True)
class Position:
    """One output position as the engine's logprobs processor holds it: the candidates in its
    dict's order (the sampled token first; a repeated id keeps its first place), and the token
    the answer has there: the sampled one, but for beam search, which may keep another."""

    candidates: list[Candidate]
    sampled: Candidate
    detokenized: bool = True  # the engine decoded them (else: each alone, and no `bytes` for the token)


@dataclass(frozen=True)
class Unscored:
    """The prompt's first token: nothing precedes it, so it has no logprob (native: `None`)."""

    token_id: int
    text: str


class LogprobDecoder:
    """Decodes positions with the engine's rules; `context` carries the last sampled ids of a
    choice across chunks, so a multi-byte character split over chunks still resolves."""

    def __init__(self, tokenizer: Any) -> None:
        from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

        self._tokenizer = tokenizer
        self._convert = convert_ids_list_to_tokens

    def positions(
        self, logprobs: dict[str, Any] | None, context: list[int], detokenized: bool = True
    ) -> list[Position]:
        """Every entry of a generate choice's `logprobs.content`; `context` is advanced in place.
        Not `detokenized` (`sampling_params.detokenize` false, as native's beam search asks):
        native's API server decodes each candidate alone (`_get_decoded_token`)."""
        out: list[Position] = []
        for entry in (logprobs or {}).get("content") or []:
            out.append(self._position(entry, context) if detokenized else self._decoded_alone(entry))
            context.append(int(entry["token_id"]))
            del context[:-CONTEXT_WINDOW]
        return out

    def prompt_positions(self, prompt_logprobs: Sequence[Any], prompt_ids: Sequence[int]) -> list[Position | Unscored]:
        """A whole answer's `prompt_logprobs` (per prompt position: None, or `{id: {logprob,
        rank, ...}}` with the prompt's own id first) decoded as the engine decodes them: the
        context is the scored prompt ids before each position."""
        out: list[Position | Unscored] = []
        context: list[int] = []
        for token_id, entry in zip(prompt_ids, prompt_logprobs, strict=False):
            if not entry:
                out.append(Unscored(token_id, str(self._tokenizer.decode(token_id))))
                continue
            (first, scored), *rest = entry.items()
            content = {
                "token_id": int(first),
                "logprob": scored.get("logprob"),
                "rank": scored.get("rank"),
                "top_logprobs": [
                    {"token_id": int(k), "logprob": v.get("logprob"), "rank": v.get("rank")} for k, v in rest
                ],
            }
            out.append(self._position(content, context))
            context.append(int(first))
            del context[:-CONTEXT_WINDOW]
        return out

    def _position(self, entry: dict[str, Any], context: list[int]) -> Position:
        seen = _candidates(entry)
        ids = list(seen)
        decoded = self._convert(self._tokenizer, ids)
        for i, text in enumerate(decoded):
            if text.endswith("\ufffd"):
                decoded[i] = self._correct(ids[i], context)
        return _at(entry, [Candidate(t, seen[t][0], decoded[i], seen[t][1]) for i, t in enumerate(ids)])

    def _decoded_alone(self, entry: dict[str, Any]) -> Position:
        seen = _candidates(entry)
        decode = self._tokenizer.decode
        candidates = [Candidate(t, logprob, str(decode(t)), rank) for t, (logprob, rank) in seen.items()]
        return _at(entry, candidates, detokenized=False)

    def _correct(self, token_id: int, context: list[int]) -> str:
        """The engine's `_correct_decoded_token`: decode with preceding ids, keep the new part."""
        decode = self._tokenizer.decode
        for n in range(1, min(len(context), CONTEXT_WINDOW) + 1):
            window = context[-n:]
            full = decode(window + [token_id])
            if full.endswith("\ufffd"):
                continue
            clean_end = len(window)
            for j in range(len(window) - 1, -1, -1):
                if decode([window[j]]).endswith("\ufffd"):
                    clean_end = j
                else:
                    break
            prefix = decode(window[:clean_end]) if clean_end > 0 else ""
            if full.startswith(prefix):
                return str(full[len(prefix) :])
            common = 0
            for a, b in zip(prefix, full, strict=False):
                if a != b:
                    break
                common += 1
            return str(full[common:])
        return ""


def detokenized(params: dict[str, Any]) -> bool:
    """Whether the engine decoded the answer's logprob tokens (`positions`)."""
    return params.get("detokenize") is not False


def _candidates(entry: dict[str, Any]) -> dict[int, tuple[float, int | None]]:
    """A generate entry's candidates in the engine's dict order: its `top_logprobs` (the
    sampled token first), each id once; the entry's own token first when they lack it."""
    seen: dict[int, tuple[float, int | None]] = {}
    for top in entry.get("top_logprobs") or []:
        seen.setdefault(int(top["token_id"]), (_clamp(top.get("logprob")), top.get("rank")))
    token = int(entry["token_id"])
    if token not in seen:
        seen = {token: (_clamp(entry.get("logprob")), entry.get("rank")), **seen}
    return seen


def _at(entry: dict[str, Any], candidates: list[Candidate], detokenized: bool = True) -> Position:
    """The position whose answer has the entry's token."""
    token = int(entry["token_id"])
    taken = next(c for c in candidates if c.token_id == token)
    if taken.logprob != _clamp(entry.get("logprob")):  # its own logprob, where a list repeats it otherwise
        taken = Candidate(token, _clamp(entry.get("logprob")), taken.text, entry.get("rank"))
    return Position(candidates, taken, detokenized)


def _clamp(value: Any) -> float:
    return NAN_LOGPROB if value is None else max(float(value), NAN_LOGPROB)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


TOKEN_ID_PREFIX = "token_id:"  # vLLM's `format_token_id_placeholder`


def _token(token_id: int, text: str, as_ids: bool) -> str:
    """A logprob entry's token: its text, or `token_id:<id>` (`return_tokens_as_token_ids`)."""
    return f"{TOKEN_ID_PREFIX}{token_id}" if as_ids else text


def token_id_of(token: str) -> int:
    """The id a logprob token named by id stands for (`_token`'s inverse)."""
    if not token.startswith(TOKEN_ID_PREFIX):
        raise ValueError(f"a logprob token without its id: {token!r}")
    return int(token.removeprefix(TOKEN_ID_PREFIX))


def chat_logprobs(positions: Sequence[Position], top_logprobs: int | None, as_ids: bool = False) -> dict[str, Any]:
    """`ChatCompletionLogProbs` as native chat serving builds it (`_create_chat_logprobs`):
    with `as_ids` the tokens are ids, the sampled token's bytes still its text's."""
    content = []
    for position in positions:
        tops = []
        for i, c in enumerate(position.candidates):
            if top_logprobs == -1 or (top_logprobs is not None and i < top_logprobs):
                token = _token(c.token_id, c.text, as_ids)
                tops.append({"token": token, "logprob": c.logprob, "bytes": _bytes(token)})
        sampled = position.sampled
        content.append(
            {
                "token": _token(sampled.token_id, sampled.text, as_ids),
                "logprob": sampled.logprob,
                "bytes": _bytes(sampled.text) if position.detokenized else None,
                "top_logprobs": tops,
            }
        )
    return {"content": content}


def prompt_logprobs_field(positions: Sequence[Position | Unscored]) -> list[dict[str, Any] | None]:
    """The `prompt_logprobs` field of native answers: per position None or `{id: Logprob}`."""
    return [
        None
        if isinstance(position, Unscored)
        else {
            str(c.token_id): {"logprob": c.logprob, "rank": c.rank, "decoded_token": c.text}
            for c in position.candidates
        }
        for position in positions
    ]


def completion_logprobs(
    positions: Sequence[Position | Unscored], top: int, text_offset: int, as_ids: bool = False
) -> dict[str, Any]:
    """`CompletionLogProbs` as native completions serving builds it; `text_offset` is where
    this chunk's first token starts in the choice's text (advanced, as natively, by each
    token's length: an id's with `as_ids`). The sampled token and the engine's first `top`
    candidates are kept (`_kept`). An echoed prompt's first token has no logprob."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for position in positions:
        offsets.append(text_offset if not offsets else offsets[-1] + len(tokens[-1]))
        if isinstance(position, Unscored):
            tokens.append(_token(position.token_id, position.text, as_ids))
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        tokens.append(_token(position.sampled.token_id, position.sampled.text, as_ids))
        token_logprobs.append(position.sampled.logprob)
        kept = [c for i, c in enumerate(position.candidates) if _kept(i, c.rank, top)]
        top_logprobs.append({_token(c.token_id, c.text, as_ids): c.logprob for c in kept})
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top_logprobs}


def _kept(index: int, rank: int | None, top: int) -> bool:
    """Whether a completions answer shows a position's candidate: the sampled token (first)
    and the engine's first `top` candidates, in its order. The engine may have been asked for
    one more (`token_only.engine_logprobs`), which goes. A candidate's rank is its place in
    the engine's topk (vLLM's `append_logprobs_for_next_position`), not a rank by value, so
    tied candidates are kept or dropped as the engine ordered them."""
    return top == -1 or index == 0 or (rank or 0) <= top


def trim_completion_candidates(generate: dict[str, Any], top: int) -> None:
    """For a derenderer that shows every candidate it gets (the sidecar): keep, in place,
    the candidates a completions answer shows (`_kept`)."""
    _trim(generate, lambda i, rank: _kept(i, rank, top))


def trim_chat_candidates(generate: dict[str, Any], top: int | None) -> None:
    """Likewise for chat, which shows the engine's first `top_logprobs` candidates (none when
    unset or 0, where generate still keeps one: it cuts its list at max(k, 1))."""
    _trim(generate, lambda i, _: top == -1 or (top is not None and i < top))


def _trim(generate: dict[str, Any], kept: Callable[[int, int | None], bool]) -> None:
    for choice in generate.get("choices") or []:
        for entry in (choice.get("logprobs") or {}).get("content") or []:
            tops = entry.get("top_logprobs") or []
            entry["top_logprobs"] = [t for i, t in enumerate(tops) if kept(i, t.get("rank"))]
