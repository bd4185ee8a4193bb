"""What vLLM's parser engine derives from the tokenizer alone, made once per model.

Every engine-based parser (one per choice of every request, and one more when a whole answer
counts its reasoning tokens) builds a `StreamingParserEngine`, whose `__init__` calls
`_build_drop_info(config, tokenizer)` (vllm/parser/engine/streaming_parser_engine.py): one
regex per special token the grammar does not name, all sorted into a new `LexerShape`. That
was over a third of a streamed chat's set-up CPU with the 7 special tokens of the tiny test
model (more with a real one's), and its result depends on nothing a request brings: the
config (frozen; the qwen3 ones are `functools.cache`d by `qwen3_config`) and the tokenizer's
`all_special_tokens` / `all_special_ids`, which vLLM's `get_cached_tokenizer` freezes when it
loads the tokenizer. Engines only read it: `resolved_token_ids.update(...)`
copies its ids, and `IncrementalLexer` only reads a `LexerShape`, which vLLM already shares
between engines (`ParserEngineConfig.lexer_shape`, "shared across all IncrementalLexer
instances"). So the derender's tokenizers get it once per config, every other caller keeps
vLLM's own function.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import lru_cache
from typing import Any

# configs seen per process: a few per parser (thinking on/off); a bound keeps a parser that
# made a config per instance from holding them all
CONFIGS_KEPT = 64

_install = threading.Lock()


class Same:
    """An object as a cache key by identity (a parser config holds dicts: it has no hash). The
    key holds the object, so no other object can take its id while it is cached."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.obj is self.obj


class SharedDropInfo:
    """vLLM's `_build_drop_info`, once per (config, tokenizer) for the registered tokenizers."""

    def __init__(self, build: Callable[[Any, Any], Any]) -> None:
        self.build = build  # vLLM's own
        self._tokenizers: set[Same] = set()
        self._shared = lru_cache(maxsize=CONFIGS_KEPT)(self._build)

    def add(self, tokenizer: Any) -> None:
        self._tokenizers.add(Same(tokenizer))

    def __call__(self, config: Any, tokenizer: Any) -> Any:
        key = Same(tokenizer)
        if key not in self._tokenizers:
            return self.build(config, tokenizer)
        return self._shared(Same(config), key)

    def _build(self, config: Same, tokenizer: Same) -> Any:
        return self.build(config.obj, tokenizer.obj)


def share_drop_info(tokenizer: Any) -> None:
    """From now on, parsers made with this tokenizer share their engines' drop info."""
    from vllm.parser.engine import streaming_parser_engine as engine

    with _install:
        if not isinstance(engine._build_drop_info, SharedDropInfo):
            engine._build_drop_info = SharedDropInfo(engine._build_drop_info)
        engine._build_drop_info.add(tokenizer)
