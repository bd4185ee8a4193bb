"""What the planner refuses, and why, as the client's error."""

from __future__ import annotations

from ext_proc.errors import GatewayError
from ext_proc.protocol import OpenAIRequest
from scheduler import Rejection

ECHO_NEEDS_IN_PROCESS = (
    "`echo` needs the in-process derender (derender.mode: in_process): the render sidecar's"
    " /derender does not repeat the prompt"
)
IDS_NEED_IN_PROCESS = (
    "`return_tokens_as_token_ids` with logprobs needs the in-process derender (derender.mode: in_process):"
    " the render sidecar's /derender names logprob tokens by their text"
)
TRIGGER_BATCH_OBFUSCATED = (
    "multi-prompt requests on a Trigger prefill/decode pool are served by an engine's native endpoint,"
    " which token obfuscation forbids"
)


def refuse_what_the_sidecar_cannot_derender(request: OpenAIRequest) -> None:
    if request.echo:
        raise GatewayError(400, ECHO_NEEDS_IN_PROCESS, param="echo", code="unsupported_with_sidecar_derender")
    body = request.body
    if body.get("return_tokens_as_token_ids") and body.get("logprobs") not in (None, False):
        param = "return_tokens_as_token_ids"
        raise GatewayError(400, IDS_NEED_IN_PROCESS, param=param, code="unsupported_with_sidecar_derender")


def without_pair(unpaired: Rejection | None, alone: Rejection) -> Rejection:
    """Why a request has no instance: with prefill/decode pools, why no pair was found (the
    instance that may serve alone is only the fallback)."""
    if unpaired is None or alone.status == 429:
        return alone
    return Rejection(unpaired.status, f"no prefill/decode pair available: {unpaired.reason}")


def rejected(rejection: Rejection) -> GatewayError:
    """Scheduling's refusal as the client's error."""
    codes = {429: "token_budget_exceeded", 400: "context_length_exceeded"}
    code = codes.get(rejection.status, "no_healthy_instance")
    return GatewayError(rejection.status, rejection.reason, param="messages" if code == codes[400] else None, code=code)


def token_only_required(address: str) -> GatewayError:
    return GatewayError(
        503,
        f"engine {address} has no token-only generate, and token obfuscation forbids its native endpoint",
        code="token_only_required",
    )
