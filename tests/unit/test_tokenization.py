"""The local-tokenizer fallback, as vLLM serves by default: a client's own chat template is
refused, only the template variables the model's template declares are passed on, and the
work is bounded by a timeout."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from ext_proc.errors import GatewayError
from ext_proc.frontend.tokenization import LocalTokenizer
from ext_proc.protocol import OpenAIRequest, Pipeline
from tests.conftest import missing


@pytest.fixture(scope="module")
def model_path() -> str:
    try:
        from ext_proc.tools.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model(Path("~/.cache/tito").expanduser()))
    except ImportError:
        missing("transformers/torch (pip install -e .[engine])")
        raise


def _chat(**fields: Any) -> OpenAIRequest:
    return OpenAIRequest(Pipeline.CHAT, {"messages": [{"role": "user", "content": "hi"}], **fields})


def test_a_client_chat_template_is_refused(model_path: str) -> None:
    tokenizer = LocalTokenizer(model_path)
    for request in (_chat(chat_template="{{ 7 * 7 }}"), _chat(chat_template_kwargs={"chat_template": "{{ x }}"})):
        with pytest.raises(GatewayError) as refused:
            asyncio.run(tokenizer.token_ids(request))
        assert refused.value.status == 400 and "untrusted chat template" in refused.value.message
    with pytest.raises(GatewayError) as unexpected:
        asyncio.run(tokenizer.token_ids(_chat(chat_template_kwargs={"tokenize": False})))
    assert unexpected.value.status == 400


def test_only_the_templates_own_variables_are_passed_on(model_path: str) -> None:
    tokenizer = LocalTokenizer(model_path)
    plain = asyncio.run(tokenizer.token_ids(_chat()))
    noisy = _chat(chat_template_kwargs={"messages": [], "unknown": 1, "enable_thinking": False})
    no_thinking = asyncio.run(tokenizer.token_ids(noisy))
    assert tokenizer._template_kwargs(noisy) == {"enable_thinking": False}
    decoded = tokenizer._tokenizer.decode(no_thinking)
    assert len(no_thinking) > len(plain) and decoded.endswith("<think>\n\n</think>")


def test_the_work_is_bounded_by_a_timeout(model_path: str) -> None:
    tokenizer = LocalTokenizer(model_path, timeout_s=0.05)
    asyncio.run(tokenizer.token_ids(_chat()))  # loaded; the load itself is not bounded per request
    slow = tokenizer._encode

    def stalls(*args: Any) -> list[int]:
        time.sleep(0.5)
        return slow(*args)

    tokenizer._encode = stalls  # type: ignore[method-assign]
    with pytest.raises(TimeoutError):
        asyncio.run(tokenizer.token_ids(_chat()))
