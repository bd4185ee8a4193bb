"""What the gateway reads from the model's own files (no tokenizer, no vLLM)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=8)
def vocab_size(model_path: str | None) -> int | None:
    """The model's vocabulary size from `config.json` (`text_config.vocab_size` first, as
    multimodal models nest it); None when unknown, e.g. a hub name or no path."""
    if not model_path:
        return None
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for section in (config.get("text_config") or {}, config):
        size = section.get("vocab_size") if isinstance(section, dict) else None
        if isinstance(size, int) and size > 0:
            return size
    return None
