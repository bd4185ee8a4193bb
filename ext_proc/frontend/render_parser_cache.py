"""In-process render's parsers, built once per distinct construction instead of twice per request.

vLLM's renderer builds its reasoning and tool parser twice for every chat render: once in
`preprocess_chat` to call `adjust_request`, once in `render_chat_request` to call
`is_reasoning_end` on the prompt. Building one compiles its lexer and grammar tables (about
0.3 ms on the tiny model, half of a cached in-process render's CPU). On those render-side
instances vLLM calls only `adjust_request`, which sets fields of the request, and
`is_reasoning_end`, which vLLM documents as a pure function of the prompt ids; neither reads
state the other leaves. So an instance built with equal arguments (the same tokenizer and
model config, tools and keyword arguments equal as JSON) answers exactly as a fresh one, and
clients that send the same tools every turn (agents, chat front ends) build none.

What cannot be keyed as JSON (extra positional arguments, values JSON cannot write) is built
fresh, as vLLM would."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import orjson


class ReusedParsers:
    """Stands in for vLLM's parser class on the renderer: called as the class, answers with a
    kept instance when one was built with equal arguments; its class attributes read through."""

    def __init__(self, parser_cls: Any, max_entries: int = 256) -> None:
        self._cls = parser_cls
        self._max = max_entries
        self._kept: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        # the last tools list and its JSON: one render passes the same list to both constructions
        self._last_tools: tuple[Any, tuple[str, ...] | None] = (None, None)
        self.built = 0
        self.reused = 0

    def __getattr__(self, name: str) -> Any:  # reasoning_parser_cls, tool_parser_cls, ...
        return getattr(self._cls, name)

    def __call__(self, tokenizer: Any, tools: Any = None, *args: Any, **kwargs: Any) -> Any:
        key = None if args else self._key(tokenizer, tools, kwargs)
        if key is not None and (parser := self._kept.get(key)) is not None:
            self._kept.move_to_end(key)
            self.reused += 1
            return parser
        parser = self._cls(tokenizer, tools, *args, **kwargs)
        self.built += 1
        if key is not None:
            self._kept[key] = parser
            if len(self._kept) > self._max:
                self._kept.popitem(last=False)
        return parser

    def _key(self, tokenizer: Any, tools: Any, kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
        """What the construction depends on; None when some of it cannot be written as JSON."""
        model_config = kwargs.get("model_config")
        rest = {k: v for k, v in kwargs.items() if k != "model_config"}
        try:
            rest_json = orjson.dumps(rest, option=orjson.OPT_SORT_KEYS)
            last, tools_json = self._last_tools
            if tools is not last or tools is None:
                tools_json = tuple(tool.model_dump_json() for tool in tools) if tools is not None else None
                self._last_tools = (tools, tools_json)  # held, so its id is not reused meanwhile
        except (AttributeError, TypeError, ValueError):
            return None
        return id(tokenizer), id(model_config), tools_json, rest_json


def install(online_renderer: Any) -> ReusedParsers | None:
    """Put the stand-in in place of the renderer's parser class (None: no parser configured).
    vLLM's serving object reads the class through its online renderer, so both sites see it."""
    if online_renderer.parser is None:
        return None
    reused = ReusedParsers(online_renderer.parser)
    online_renderer.parser = reused
    return reused
