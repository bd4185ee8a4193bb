"""Token In: render first; on render failure, the local tokenizer (RFC "Render Token In fallback").

The local tokenizer only guarantees prompt token ids for admission and scheduling. It cannot
reproduce render's metadata (merged generation defaults, parser adjustments), so a locally
tokenized request goes the native engine path, never as an incomplete token-only request.
The render pool (`render_pool.py`) retries another endpoint and skips failed ones; only when
no endpoint renders does the local tokenizer serve. Render's own verdicts on a request
(400/422, unknown model) are never a reason to fall back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

from ext_proc.errors import GatewayError
from ext_proc.extras import PROCESSOR, require
from ext_proc.frontend.render import (
    RenderRejected,
    RenderUnavailable,
    beam_search_refused,
    beam_searched,
    without_beam_search,
)
from ext_proc.frontend.render_pool import RenderPool
from ext_proc.obfuscation import TokenCodec
from ext_proc.observability.request import current
from ext_proc.protocol import OpenAIRequest, Pipeline, PromptTokens, TokenizedRequest

log = logging.getLogger("tito.tokenization")


UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)
# Never template variables a client may set: they are the call itself.
_RESERVED_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize", "messages", "tools", "conversation", "return_dict"})
_HF_TEMPLATE_PARAMS = frozenset({"add_generation_prompt", "continue_final_message", "documents"})
MAX_TOKEN_ID = 1 << 31  # when the vocabulary size is unknown: no tokenizer has more ids


class LocalTokenizer:
    """The engines' own tokenizer and chat template, loaded on the first real fallback, off the loop.

    As vLLM serves by default: a client's own chat template is refused, and of its
    `chat_template_kwargs` only the variables the model's template declares are passed on.
    The work is bounded by `timeout_s` (the thread cannot be interrupted, but the request
    stops waiting for it and goes the native path)."""

    def __init__(self, model_path: str | None, timeout_s: float = 10.0) -> None:
        self._model_path = model_path
        self._timeout_s = timeout_s
        self._tokenizer: Any = None
        self._template_vars: frozenset[str] = frozenset()
        self._lock = asyncio.Lock()

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    async def token_ids(self, request: OpenAIRequest) -> list[int]:
        kwargs = self._template_kwargs(request)
        if self._tokenizer is None:
            async with self._lock:
                if self._tokenizer is None:
                    self._tokenizer = await asyncio.to_thread(self._load)
        return await asyncio.wait_for(asyncio.to_thread(self._encode, request, kwargs), self._timeout_s)

    def _template_kwargs(self, request: OpenAIRequest) -> dict[str, Any]:
        """The client's chat-template kwargs vLLM would accept; a client template is a 400."""
        if request.api is not Pipeline.CHAT:
            return {}
        kwargs = request.body.get("chat_template_kwargs") or {}
        if request.body.get("chat_template") is not None or (
            isinstance(kwargs, dict) and kwargs.get("chat_template") is not None
        ):
            raise GatewayError(400, UNTRUSTED_TEMPLATE, param="chat_template", code="untrusted_chat_template")
        if not isinstance(kwargs, dict):
            raise GatewayError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
        if "tokenize" in kwargs:
            message = "Found unexpected chat template kwargs from request: {'tokenize'}"
            raise GatewayError(400, message, param="chat_template_kwargs")
        accepted = (self._template_vars | _HF_TEMPLATE_PARAMS) - _RESERVED_TEMPLATE_KWARGS
        return {k: v for k, v in kwargs.items() if k in accepted}

    def _load(self) -> Any:
        if not self._model_path:
            raise RuntimeError("no model path configured for the local tokenizer")
        require("the local tokenizer (render fallback)", PROCESSOR, "transformers")
        import jinja2.meta  # heavy imports: only on the first fallback
        import jinja2.sandbox
        from transformers import AutoTokenizer

        log.info("loading the local tokenizer from %s", self._model_path)
        tokenizer = AutoTokenizer.from_pretrained(self._model_path)
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        parsed = jinja2.sandbox.ImmutableSandboxedEnvironment().parse(template)
        self._template_vars = frozenset(jinja2.meta.find_undeclared_variables(parsed))
        return tokenizer

    def _encode(self, request: OpenAIRequest, template_kwargs: dict[str, Any]) -> list[int]:
        body = request.body
        if request.api is Pipeline.CHAT:
            ids = self._tokenizer.apply_chat_template(
                body["messages"],
                tools=body.get("tools"),
                tokenize=True,
                **{"add_generation_prompt": True, **template_kwargs},
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer transformers
                ids = ids["input_ids"]
            return list(ids)
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list):  # already token ids
            return [int(t) for t in prompt]
        return list(self._tokenizer.encode(prompt))


def check_token_ids(prompt: Any, vocab: int | None, stream: bool) -> None:
    """A client's token-id prompts (`[1, 2]` or `[[1, 2], [3]]`): each prompt's lowest and
    highest id in the vocabulary, as native's engine checks them (`validate_token_ids`), in
    its words, before anything is admitted or sent. Native's engine checks them while
    generating, so a streaming request (`stream`) gets the error inside its stream."""
    if not isinstance(prompt, list):
        return
    limit = vocab or MAX_TOKEN_ID
    for ids in prompt if prompt and isinstance(prompt[0], list) else [prompt]:
        if not ids or not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            continue  # text prompts, tokenized by render
        lowest, highest = min(ids), max(ids)
        if lowest < 0 or highest >= limit:
            bad = lowest if lowest < 0 else highest
            message = f"Token id {bad} is out of vocabulary"
            raise GatewayError(400, message, code=400, kind="BadRequestError", in_stream=stream)


class TokenizationService:
    def __init__(
        self,
        render: RenderPool | None,
        local: LocalTokenizer,
        codec: TokenCodec | None = None,
        vocab: int | None = None,
    ) -> None:
        self.pool = render  # None: render disabled in the config
        self.local = local
        self.codec = codec  # token obfuscation: physical ids for the engines, and no fallback
        self.vocab = vocab  # the model's vocabulary size (None: unknown)
        self.fallbacks: Counter[str] = Counter()

    async def tokenize(self, request: OpenAIRequest, raw: bytes, request_id: str) -> TokenizedRequest:
        started = time.perf_counter()
        if self.pool is None:
            return await self._fallback(request, request_id, "render_disabled", started)
        try:
            tokenized = await self._render(self.pool, request, raw, request_id)
        except RenderUnavailable as exc:  # every endpoint failed or is skipped (RenderRejected: raised)
            return await self._fallback(request, request_id, exc.reason, started)
        if (record := current()) is not None:
            record.rendered(started, "render")
        if request.api is Pipeline.COMPLETIONS:  # (render takes a client's ids as they come)
            check_token_ids(request.body.get("prompt"), self.vocab, tokenized.stream)
        return tokenized if self.codec is None else self.codec.physical(tokenized)

    @staticmethod
    async def _render(pool: RenderPool, request: OpenAIRequest, raw: bytes, request_id: str) -> TokenizedRequest:
        try:
            return await pool.render(request, raw, request_id)
        except RenderRejected as refusal:
            if not beam_search_refused(request, refusal):
                raise
        return beam_searched(await pool.render(request, without_beam_search(raw), request_id), request)

    async def _fallback(self, request: OpenAIRequest, request_id: str, reason: str, started: float) -> TokenizedRequest:
        self.fallbacks[reason] += 1
        record = current()
        if self.codec is not None:  # fail closed: local ids would reach the engines unpermuted
            if record is not None:
                record.rendered(started, "refused", reason)
            message = f"render is unavailable ({reason}) and token obfuscation allows no fallback"
            raise GatewayError(503, message, code="render_unavailable")
        try:  # (a body only its own endpoint reads has no local rendering: its engine renders it natively)
            ids = [] if request.path is not None else await self.local.token_ids(request)
        except GatewayError:  # the request itself is refused (a client chat template)
            raise
        except Exception as exc:  # noqa: BLE001 - no ids is still a servable request (native path)
            log.warning("local tokenizer failed for %s: %r", request_id, exc)
            ids = []
        if record is not None:
            record.rendered(started, "local_tokenizer", reason)
        prefix = "chatcmpl-" if request.api is Pipeline.CHAT else "cmpl-"
        return TokenizedRequest(request, prefix + request_id, [PromptTokens(ids)], tokenizer_source="local")

    def snapshot(self) -> dict[str, Any]:
        pool = self.pool
        held_out = pool is not None and all(m.held_out for m in pool.members)
        return {
            "render_breaker": pool.state() if pool is not None else "open",
            "render_held_out": "render_canary_mismatch" if held_out else None,
            "render_endpoints": pool.snapshot() if pool is not None else {},
            "local_tokenizer_loaded": self.local.loaded,
            "fallbacks": dict(self.fallbacks),
        }
