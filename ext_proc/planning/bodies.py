"""What an engine gets for a leg: token-only generate bodies, rendered under the adapter's name."""

from __future__ import annotations

from ext_proc.frontend.token_only import generate_body
from ext_proc.planning.plan import TokenOnly
from ext_proc.protocol import TokenizedRequest


def routed_body(plan: TokenOnly) -> bytes:
    """The generate body of the leg Envoy routes (after a Handoff, with prefill's KV params)."""
    leg = plan.routed
    return generate_body(
        leg.prompt,
        leg.max_tokens,
        plan.tokenized.shows_sampled_beside_k,
        request_id=leg.lease_id,
        kv_transfer_params=plan.kv_transfer_params,
        stream=plan.tokenized.generate_streams,
        stream_interval=plan.stream_interval,
    )


def prefill_body(plan: TokenOnly) -> bytes:
    leg = plan.prefill
    assert leg is not None
    return generate_body(
        leg.prompt, leg.max_tokens, plan.tokenized.shows_sampled_beside_k, request_id=leg.lease_id, prefill=True
    )


def with_adapter(tokenized: TokenizedRequest) -> TokenizedRequest:
    """Engines get the adapter's name as `model` (token-only generate names a LoRA adapter
    only that way); render rendered the request under the base's."""
    adapter = tokenized.request.adapter
    if adapter is None:
        return tokenized
    for prompt in tokenized.prompts:
        for rendered in (prompt.generate_request, prompt.engine_request):
            if rendered is not None:
                rendered["model"] = adapter.name
    return tokenized
