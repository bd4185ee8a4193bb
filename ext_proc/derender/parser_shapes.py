"""What vLLM's parser engine derives from its config and the tokenizer alone, made once per model.

Every engine-based parser (one per choice of every request, and one more when a whole answer
counts its reasoning tokens) builds a `StreamingParserEngine`, whose `__init__`
(vllm/parser/engine/streaming_parser_engine.py) derives, from nothing a request brings: the
token ids of the config's terminals; the special tokens the grammar does not name
(`_build_drop_info`: one regex per special token, sorted into a new `LexerShape`); and the
terminals of tool calls and of reasoning markup (three walks of the config's transitions).
Building the lexer table alone was over a third of a streamed chat's set-up CPU with the 7
special tokens of the tiny test model (more with a real one's), and the walks were the most
of what was left of the engine's `__init__`. The config is frozen (the qwen3 ones are
`functools.cache`d by `qwen3_config`), and so are the tokenizer's special tokens and vocab
(vLLM's `get_cached_tokenizer` freezes them when it loads the tokenizer).

So for the derender's tokenizers, vLLM's own `__init__` runs once per config: the prototype.
Every later engine takes the prototype's derived fields, which engines only read (the lexer
shape, which vLLM already shares between lexers: "shared across all IncrementalLexer
instances"; the terminal sets, frozen), and a state of its own: its own copy of the resolved
token ids, a new scanner and lexer made as `__init__` makes them, the skip flags off, then
`reset()` (vLLM's own way to reuse an engine for another request). Engines made with any
other tokenizer or vocab run vLLM's `__init__`.
"""

from __future__ import annotations

import threading
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


class SharedEngines:
    """`StreamingParserEngine.__init__` from a prototype per (config, tokenizer), for the
    registered tokenizers; `init` is vLLM's own."""

    def __init__(self, init: Any) -> None:
        from vllm.parser.engine.incremental_lexer import IncrementalLexer
        from vllm.parser.engine.token_id_scanner import TokenIDScanner

        self.init = init
        self._lexer, self._scanner = IncrementalLexer, TokenIDScanner  # what each engine gets anew
        self._tokenizers: set[Same] = set()
        self._prototypes = lru_cache(maxsize=CONFIGS_KEPT)(self._prototype)

    def add(self, tokenizer: Any) -> None:
        self._tokenizers.add(Same(tokenizer))

    def make(
        self, engine: Any, config: Any, tokenizer: Any, initial_state: Any = None, vocab: dict[str, int] | None = None
    ) -> None:
        key = Same(tokenizer)
        if key not in self._tokenizers or (vocab is not None and vocab is not tokenizer.get_vocab()):
            self.init(engine, config, tokenizer, initial_state=initial_state, vocab=vocab)
            return
        prototype = self._prototypes(Same(config), key)
        engine.__dict__.update(prototype.__dict__)  # the derived fields (the state is set below)
        engine._resolved_token_ids = dict(prototype._resolved_token_ids)
        engine._scanner = self._scanner(engine._resolved_token_ids, tokenizer)
        lexer = prototype._lexer
        engine._lexer = self._lexer(lexer._shape, content_terminal=lexer.content_terminal)
        engine.skip_tool_parsing = False
        engine.skip_reasoning_parsing = False
        engine.reset(initial_state=initial_state)

    def _prototype(self, config: Same, tokenizer: Same) -> Any:
        from vllm.parser.engine.streaming_parser_engine import StreamingParserEngine

        prototype = StreamingParserEngine.__new__(StreamingParserEngine)
        self.init(prototype, config.obj, tokenizer.obj)
        return prototype


_shared: SharedEngines | None = None


def _from_prototype(
    engine: Any, config: Any, tokenizer: Any, initial_state: Any = None, vocab: dict[str, int] | None = None
) -> None:
    """`StreamingParserEngine.__init__` once `share_parser_engines` ran."""
    assert _shared is not None
    _shared.make(engine, config, tokenizer, initial_state, vocab)


def share_parser_engines(tokenizer: Any) -> SharedEngines:
    """From now on, parser engines made with this tokenizer start from a prototype per config."""
    global _shared
    from vllm.parser.engine.streaming_parser_engine import StreamingParserEngine

    with _install:
        if _shared is None:
            _shared = SharedEngines(StreamingParserEngine.__init__)
            StreamingParserEngine.__init__ = _from_prototype  # type: ignore[method-assign, assignment]
        _shared.add(tokenizer)
        return _shared
