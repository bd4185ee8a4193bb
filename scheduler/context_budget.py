"""Context budget: max_tokens never exceeds what the model's context leaves after the prompt."""

from __future__ import annotations


class ContextOverflow(ValueError):
    """The prompt alone does not fit the model's context."""


def clamp_max_tokens(prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    remaining = max_model_len - prompt_tokens
    if remaining < 1:
        raise ContextOverflow(
            f"the prompt has {prompt_tokens} tokens, the model's context is {max_model_len}: no room for a completion"
        )
    return min(max_tokens, remaining)
