"""Completions answers as `OpenAIServingCompletion` (0.32) makes them: the stream for one
prompt, and the whole answer; `echo` repeats the prompt and its logprobs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import orjson

from ext_proc.derender.logprobs import (
    Position,
    Unscored,
    completion_logprobs,
    detokenized,
    prompt_logprobs_field,
)
from ext_proc.derender.model import DerenderModel, cached_tokens
from ext_proc.derender.session import Session, Step, final_text
from ext_proc.errors import GatewayError
from ext_proc.protocol import PromptTokens, TokenizedRequest


class CompletionStream(Session):
    """`OpenAIServingCompletion.completion_stream_generator` for one prompt."""

    _object = "text_completion"

    def __init__(self, model: DerenderModel, request: TokenizedRequest, prompt_index: int = 0) -> None:
        super().__init__(model, request, prompt_index, model.client_request(request))
        self._prompt_index = prompt_index
        self._prompt_positions: list[Position | Unscored] | None = None

    def _usage(self, completion_tokens: int) -> dict[str, Any]:
        prompt = self._prompt_tokens
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion_tokens,
            "completion_tokens": completion_tokens,
        }

    def _usage_chunk(self) -> dict[str, Any]:
        usage = self._usage(sum(c.num_tokens for c in self._choices.values()))
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = self._model.prompt_details(
                False, self._prompt_tokens, self.cached_tokens, False
            )
        return self._chunk([], usage=usage)

    def _step(self, step: Step) -> dict[str, Any] | None:
        choice = self._choice(step.index, parser=False)
        text = choice.text(step)
        index = step.index + self._prompt_index * self._n
        echo = self._client.echo and not choice.prompt_shown
        # native: the prompt's ids go with the choice's first output (echo), or its first
        # output at all with `return_token_ids`, even one with nothing to show
        show_prompt = not choice.prompt_shown and (echo or self._client.return_token_ids)
        choice.prompt_shown = choice.prompt_shown or show_prompt
        if not echo and not text and not step.token_ids and not choice.num_tokens:
            return None
        positions = self._logprob_positions(choice, step) if self._client.logprobs is not None else None
        if echo:
            text, positions = self._echoed(text, positions)
        logprobs = None
        if positions is not None:
            as_ids = bool(self._client.return_tokens_as_token_ids)
            logprobs = completion_logprobs(positions, self._client.logprobs, choice.text_offset, as_ids)
            if logprobs["tokens"]:
                choice.text_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        choice.num_tokens += len(step.token_ids)
        data: dict[str, Any] = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": step.finish_reason,
            "stop_reason": step.stop_reason,
            "prompt_token_ids": self._prompt.token_ids if show_prompt else None,
            "token_ids": step.token_ids if self._client.return_token_ids else None,
        }
        extra: dict[str, Any] = {}
        if self._continuous_usage:
            extra["usage"] = self._usage(choice.num_tokens)
        return self._chunk([data], **extra)

    def _echoed(self, text: str, positions: list[Position] | None) -> tuple[str, list[Position | Unscored] | None]:
        """A choice's first output with the prompt before it (`echo`)."""
        if positions is not None and self._prompt_positions is None:  # once for every choice
            self._prompt_positions = scored_prompt(self._model, self._prompt, self._prompt_logprobs)
        shown = prompt_text(self._model, self._client, self._prompt, self._prompt_index)
        return echoed(shown, self._prompt_positions, text, positions, self._client.max_tokens != 0)


def prompt_text(model: DerenderModel, client: Any, prompt: PromptTokens, prompt_index: int) -> str:
    """What completions `echo` repeats: the prompt as sent, a token prompt decoded (native:
    the renderer's `_detokenize_prompt`); nothing with `return_token_ids`, whose answer
    carries the prompt's ids instead."""
    if client.return_token_ids:
        return ""
    sent = client.prompt
    if isinstance(sent, str):
        return sent
    if isinstance(sent, list) and sent and all(isinstance(p, str) for p in sent):
        return str(sent[prompt_index])
    return str(model.tokenizer.decode(prompt.token_ids))


def echoed(
    text: str,
    prompt_positions: list[Position | Unscored] | None,
    output_text: str,
    output_positions: Sequence[Position | Unscored] | None,
    generates: bool,
) -> tuple[str, list[Position | Unscored] | None]:
    """Completions `echo`: the prompt (its text and logprobs) before the choice's first output,
    or alone with `max_tokens: 0` (the engine still generated one token; native shows none)."""
    if not generates:
        return text, prompt_positions
    if output_positions is None or prompt_positions is None:
        return text + output_text, None
    return text + output_text, [*prompt_positions, *output_positions]


def scored_prompt(
    model: DerenderModel, prompt: PromptTokens, prompt_logprobs: list[Any] | None
) -> list[Position | Unscored]:
    if prompt_logprobs is None:
        raise GatewayError(502, "the engine returned no prompt logprobs", code="engine_invalid_response")
    return model.logprobs.prompt_positions(prompt_logprobs, prompt.token_ids)


def completion_response(
    model: DerenderModel, request: TokenizedRequest, generate: dict[str, Any], prompt_index: int
) -> bytes:
    client = model.client_request(request)
    prompt = request.prompts[prompt_index]
    prompt_positions = None
    if generate.get("prompt_logprobs") is not None:
        prompt_positions = model.logprobs.prompt_positions(generate["prompt_logprobs"], prompt.token_ids)
    choices: list[dict[str, Any]] = []
    completion_tokens = 0
    for output in generate.get("choices") or []:
        token_ids = list(output.get("token_ids") or [])
        completion_tokens += len(token_ids)
        text = final_text(model, prompt, prompt.sampling_params, output)
        positions: Sequence[Position | Unscored] | None = None
        if client.logprobs is not None:
            positions = model.logprobs.positions(output.get("logprobs"), [], detokenized(prompt.sampling_params))
        if client.echo:
            if positions is not None and prompt_positions is None:  # the engine sent none: 502
                prompt_positions = scored_prompt(model, prompt, generate.get("prompt_logprobs"))
            shown = prompt_text(model, client, prompt, prompt_index)
            text, positions = echoed(shown, prompt_positions, text, positions, client.max_tokens != 0)
        as_ids = bool(client.return_tokens_as_token_ids)
        logprobs = None if positions is None else completion_logprobs(positions, client.logprobs, 0, as_ids)
        choices.append(
            {
                "index": len(choices),
                "text": text,
                "logprobs": logprobs,
                "finish_reason": output.get("finish_reason"),
                "stop_reason": output.get("stop_reason"),
                "token_ids": token_ids if client.return_token_ids else None,
                "prompt_logprobs": None if prompt_positions is None else prompt_logprobs_field(prompt_positions),
                "prompt_token_ids": prompt.token_ids if client.return_token_ids else None,
                "routed_experts": None,
            }
        )
    prompt_tokens = len(prompt.token_ids)
    cached = cached_tokens(generate.get("usage"))
    return orjson.dumps(
        {
            "id": request.request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": request.request.response_model(model.served_name),
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": model.system_fingerprint(),
            "usage": {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens,
                "prompt_tokens_details": None
                if cached is None
                else model.prompt_details(False, prompt_tokens, cached, True),
                "completion_tokens_details": None,
            },
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
    )
