"""OpenAI chat and completions (`/v1/chat/completions`, `/v1/completions`): the two pipelines
themselves, so the request goes in as the client sent it and the answer comes out as the
pipeline makes it. Checked once here, before anything is rendered or admitted."""

from __future__ import annotations

from typing import Any

from ext_proc.config import ModelConfig
from ext_proc.errors import GatewayError
from ext_proc.frontend.model_catalog import ModelCatalog
from ext_proc.model_files import vocab_size
from ext_proc.planning.plan import Local, Plan
from ext_proc.planning.planner import Planner
from ext_proc.protocol import OpenAIRequest, Pipeline

MAX_TOKEN_ID = 1 << 31  # when the vocabulary size is unknown: no tokenizer has more ids
_REQUIRED = {Pipeline.CHAT: "messages", Pipeline.COMPLETIONS: "prompt"}


class OpenAIApi:
    """Chat and completions for one base model (`api.routes.ClientApi`)."""

    handlers = {"chat": Pipeline.CHAT, "completions": Pipeline.COMPLETIONS}
    generating = tuple(handlers)

    def __init__(self, planner: Planner, model: ModelConfig) -> None:
        self._planner = planner
        self._model = model

    def error(self, status: int, body: bytes) -> bytes:
        return body  # the pipelines' errors are OpenAI's

    async def plan(self, handler: str, body: dict[str, Any], raw: bytes, request_id: str) -> Plan:
        try:
            vocab = vocab_size(self._model.path)
            request = parse_request(self.handlers[handler], body, self._planner.catalog, vocab)
        except GatewayError as error:
            return Local(error.status, error.body)
        return await self._planner.plan(request, raw, request_id)


def parse_request(
    pipeline: Pipeline, body: dict[str, Any], catalog: ModelCatalog, vocab: int | None = None
) -> OpenAIRequest:
    """The body as the pipeline's request: its required field there, its token ids in the vocabulary."""
    request = OpenAIRequest(pipeline, body, catalog.resolve(body.get("model")))
    required = _REQUIRED[pipeline]
    if body.get(required) in (None, [], ""):
        raise GatewayError(
            400, f"'{required}' is a required property", param=required, code="missing_required_parameter"
        )
    if pipeline is Pipeline.COMPLETIONS:
        _check_token_ids(body["prompt"], vocab)
    return request


def _check_token_ids(prompt: Any, vocab: int | None) -> None:
    """Token-id prompts (`[1, 2]` or `[[1, 2], [3]]`): every id an int in the vocabulary,
    checked before anything is rendered, admitted or sent."""
    if not isinstance(prompt, list):
        return
    for ids in prompt if prompt and isinstance(prompt[0], list) else [prompt]:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            continue  # text prompts, or a shape render will reject with its own message
        limit = vocab or MAX_TOKEN_ID
        bad = next((t for t in ids if not 0 <= t < limit), None)
        if bad is not None:
            raise GatewayError(
                400, f"token id {bad} is out of vocabulary [0, {limit})", param="prompt", code="invalid_token_id"
            )
