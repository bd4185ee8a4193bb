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

    def token_ids(self, text: str, miss_chars: int | None = None) -> list[int] | None:
        """The ids `tokenizer(text, add_special_tokens=False)` gives; None: no boundary token, or
        more than `miss_chars` characters of it are new (and would be tokenized here)."""
        if self.splitter is None:
            return None
        parts = pieces(self.splitter, text)
        with self._lock:
            found = list(zip(parts, [self._pieces.get(piece) for piece in parts], strict=True))
            if miss_chars is not None and sum(len(p) for p, ids in found if ids is None) > miss_chars:
                return None
            for piece, ids in found:
                self.lookups += 1
                self.chars += len(piece)
                if ids is not None:
                    self._pieces.move_to_end(piece)
                    self.hits += 1
                    self.hit_chars += len(piece)
        out: list[int] = []
        for piece, ids in found:
            out.extend(ids if ids is not None else self._tokenized(piece))
        return out

    def _tokenized(self, piece: str) -> tuple[int, ...]:
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


# New characters tokenized on the event loop instead of vLLM's tokenizer threads: a chat's newest
# turn, tens of microseconds, less than the hop to a thread and back costs.
INLINE_MISS_CHARS = 1024


class CachedTokenize:
    """vLLM's `renderer._tokenize_prompt(prompt, params)` with the cache in front; whatever the
    cache cannot serve exactly goes to the original."""

    def __init__(self, renderer: Any, cache: PrefixTokenCache) -> None:
        self._renderer = renderer
        self._original: Callable[[Any, Any], Any] = renderer._tokenize_prompt
        self._cache = cache

    def __call__(self, prompt: Any, params: Any) -> Any:
        served = self.served(prompt, params)
        return served if served is not None else self._original(prompt, params)

    def served(self, prompt: Any, params: Any, miss_chars: int | None = None) -> Any | None:
        """The tokens prompt from the cache; None: the cache cannot serve it exactly (or not
        without tokenizing more than `miss_chars` new characters)."""
        renderer = self._renderer
        kwargs = params.get_encode_kwargs()
        if renderer._wants_offsets(prompt, params) or kwargs.get("add_special_tokens") or set(kwargs) - ENCODE_KWARGS:
            return None
        ids = self._cache.token_ids(prompt["prompt"], miss_chars)
        limit: int | None = kwargs.get("max_length") if kwargs.get("truncation") else None
        if ids is None or (limit is not None and len(ids) > limit):  # a cut only the tokenizer makes right
            return None
        return renderer._build_tokens_prompt(ids, prompt)


def install(renderer: Any, cache: PrefixTokenCache) -> None:
    """Route the renderer's tokenization through the cache: on the event loop when little is new,
    else in the renderer's own thread pool, as before."""
    from vllm.utils.async_utils import make_async

    tokenize = CachedTokenize(renderer, cache)
    in_thread = make_async(tokenize, executor=renderer._executor)

    async def tokenize_async(prompt: Any, params: Any) -> Any:
        served = tokenize.served(prompt, params, INLINE_MISS_CHARS)
        return served if served is not None else await in_thread(prompt, params)

    renderer._tokenize_prompt_async = tokenize_async
