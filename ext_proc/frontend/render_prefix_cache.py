"""The prefix cache of in-process render (RFC Render Pool): token ids of rendered chat text,
cached per piece between special tokens, so a conversation's earlier turns, a shared system
prompt and tool definitions are tokenized once.

Why per piece is exact: a fast tokenizer first splits its input at added special tokens and
tokenizes each piece on its own (normalizer, pre-tokenizer and model never see across a special
token). So the ids of a rendered chat are the ids of its pieces, one after another, as long as
- no boundary token strips whitespace beside it or matches only as a single word (such a token
  reaches into its neighbour: it is not used as a boundary);
- nothing is added around the ids (`add_special_tokens` false: chat's default; anything else,
  offsets, or a truncation that would cut is served uncached).
The key of a piece is its text: template kwargs, tools and the model all show in the text, and
each base model's renderer has its own cache. `tests/unit/test_render_prefix_cache.py` fuzzes
cached against uncached ids on thousands of generated conversations.

The cache is bounded by the ids it holds (least recently used pieces go first) and counts its
hits, per piece and per character, for the metrics."""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

ENCODE_KWARGS = frozenset({"add_special_tokens", "truncation", "max_length"})


class PrefixTokenCache:
    def __init__(self, tokenizer: Any, max_ids: int = 2_000_000) -> None:
        self._tokenizer = tokenizer
        self._max_ids = max_ids
        self._pieces: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._held = 0  # ids held
        self._lock = threading.Lock()  # vLLM tokenizes in a pool of threads
        self.splitter = boundary_pattern(tokenizer)
        self.lookups = self.hits = 0  # pieces
        self.chars = self.hit_chars = 0

    def token_ids(self, text: str) -> list[int] | None:
        """The ids `tokenizer(text, add_special_tokens=False)` gives; None: no boundary token."""
        if self.splitter is None:
            return None
        ids: list[int] = []
        for piece in pieces(self.splitter, text):
            ids.extend(self._piece(piece))
        return ids

    def _piece(self, piece: str) -> tuple[int, ...]:
        with self._lock:
            self.lookups += 1
            self.chars += len(piece)
            cached = self._pieces.get(piece)
            if cached is not None:
                self._pieces.move_to_end(piece)
                self.hits += 1
                self.hit_chars += len(piece)
                return cached
        ids = tuple(self._tokenizer(piece, add_special_tokens=False)["input_ids"])
        with self._lock:
            if piece not in self._pieces:
                self._pieces[piece] = ids
                self._held += len(ids)
                while self._held > self._max_ids and self._pieces:
                    _, dropped = self._pieces.popitem(last=False)
                    self._held -= len(dropped)
        return ids

    def snapshot(self) -> dict[str, Any]:
        return {
            "pieces": len(self._pieces),
            "ids": self._held,
            "lookups": self.lookups,
            "hits": self.hits,
            "hit_rate": self.hits / self.lookups if self.lookups else 0.0,
            "char_hit_rate": self.hit_chars / self.chars if self.chars else 0.0,
        }


def boundary_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """The special tokens a piece may start at: those that touch nothing beside them."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    if getattr(tokenizer, "split_special_tokens", False):  # special tokens tokenized as text
        return None
    tokens = [
        t.content
        for t in decoder.values()
        if getattr(t, "special", False)
        and not getattr(t, "lstrip", False)
        and not getattr(t, "rstrip", False)
        and not getattr(t, "single_word", False)
        and t.content
    ]
    if not tokens:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


def pieces(splitter: re.Pattern[str], text: str) -> list[str]:
    """`text` cut right before every boundary token (the first piece may be empty: dropped)."""
    starts = [m.start() for m in splitter.finditer(text)]
    cuts = [0, *(s for s in starts if s > 0), len(text)]
    return [text[a:b] for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def cached_tokenize(renderer: Any, cache: PrefixTokenCache) -> Callable[[Any, Any], Any]:
    """vLLM's `renderer._tokenize_prompt(prompt, params)` with the cache in front; whatever the
    cache cannot serve exactly goes to the original."""
    original = renderer._tokenize_prompt

    def tokenize(prompt: Any, params: Any) -> Any:
        kwargs = params.get_encode_kwargs()
        if renderer._wants_offsets(prompt, params) or kwargs.get("add_special_tokens") or set(kwargs) - ENCODE_KWARGS:
            return original(prompt, params)
        ids = cache.token_ids(prompt["prompt"])
        limit: int | None = kwargs.get("max_length") if kwargs.get("truncation") else None
        if ids is None or (limit is not None and len(ids) > limit):  # a cut only the tokenizer makes right
            return original(prompt, params)
        return renderer._build_tokens_prompt(ids, prompt)

    return tokenize


def install(renderer: Any, cache: PrefixTokenCache) -> None:
    """Route the renderer's tokenization (run in its own thread pool, as before) through the cache."""
    from vllm.utils.async_utils import make_async

    renderer._tokenize_prompt_async = make_async(cached_tokenize(renderer, cache), executor=renderer._executor)
