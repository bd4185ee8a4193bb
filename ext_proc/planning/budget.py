"""max_tokens per leg: the one place it is computed."""

from __future__ import annotations

from ext_proc.config import TitoConfig
from ext_proc.errors import GatewayError
from ext_proc.frontend.token_only import requested_max_tokens
from ext_proc.protocol import OpenAIRequest, PromptTokens, TokenizedRequest
from scheduler import ContextOverflow, Role, clamp_max_tokens

PREFILL_MAX_TOKENS = 1  # a prefill leg computes the prompt's KV and one token


def leg_max_tokens(config: TitoConfig, tokenized: TokenizedRequest, prompt: PromptTokens, role: Role) -> int:
    """What the engine of this leg may generate for this prompt.

    Rendered prompts: render's value (16 when it omitted it), clamped to the context left
    when `context_budget_mode` is on (a prompt that cannot fit is a 400). Locally tokenized
    ones go native, where the engine applies the request's own limit: counted as such."""
    if role is Role.PREFILL:
        return PREFILL_MAX_TOKENS
    prompt_len = len(prompt.token_ids)
    if not tokenized.complete:
        return requested_completion_tokens(tokenized.request, config.model.max_model_len - prompt_len)
    max_tokens = requested_max_tokens(prompt)
    if config.scheduler.context_budget_mode != "on":
        return max_tokens
    try:
        return clamp_max_tokens(prompt_len, max_tokens, config.model.max_model_len)
    except ContextOverflow as exc:
        raise GatewayError(400, str(exc), param="messages", code="context_length_exceeded") from exc


def requested_completion_tokens(request: OpenAIRequest, remaining_context: int) -> int:
    """The completion limit a native engine will apply: the request's, else the rest of the context."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = request.body.get(key)
        if isinstance(value, int) and value > 0:
            return min(value, max(remaining_context, 1))
    return max(remaining_context, 1)
