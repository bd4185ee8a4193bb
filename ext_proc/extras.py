"""What needs an optional part of tito says so, naming the extra that brings it.

`pip install tito` is the lean install: the CLI, `tito envoy-config`, `tito bench`,
`tito conformance`. The processor (vLLM's tokenizer, detokenizer and parsers for derender;
transformers for the fallback tokenizer) and `tito tiny-model` (torch, transformers) need
`tito[processor]`; `tito up` runs vLLM engines and the render server: `tito[engine]`.
"""

from __future__ import annotations

import importlib.util

PROCESSOR = "processor"
ENGINE = "engine"


class MissingExtra(ImportError):
    """A feature whose packages are not installed (the message names the extra)."""


def require(feature: str, extra: str, *modules: str) -> None:
    missing = [module for module in modules if importlib.util.find_spec(module) is None]
    if missing:
        raise MissingExtra(
            f"{feature} needs {', '.join(missing)}, which this install lacks: pip install 'tito[{extra}]'"
        )
