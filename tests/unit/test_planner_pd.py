"""What the planner makes of a batch on prefill/decode pools: one Handoff per prompt (every
lease taken, and given back when a later prompt cannot be placed), Trigger batches on the
native path (501 under token obfuscation), and errors that say no pair was found."""

from __future__ import annotations

import time
from typing import Any

import pytest

from ext_proc.config import TitoConfig
from ext_proc.errors import GatewayError
from ext_proc.planning.plan import Native, Owned
from ext_proc.planning.planner import Planner
from ext_proc.protocol import OpenAIRequest, Pipeline, PromptTokens, TokenizedRequest
from ext_proc.server import build_scheduler
from scheduler import Role

UNION, PREFILL, DECODE = "127.0.0.1:8200", "127.0.0.1:8201", "127.0.0.1:8202"


def planner(decode_capabilities: list[str], **sections: Any) -> Planner:
    pools = [
        {"name": "prefill", "role": "prefill", "instances": [{"port": 8201}]},
        {"name": "decode", "role": "decode", "instances": [{"port": 8202, "capabilities": decode_capabilities}]},
    ]
    config = TitoConfig.model_validate({"pools": pools, "scheduler": {"prefix_source": "routing"}, **sections})
    return Planner(config, None, build_scheduler(config))  # type: ignore[arg-type]


def batch(prompts: int, max_tokens: int = 4) -> TokenizedRequest:
    rendered = [
        PromptTokens.rendered(
            {"token_ids": [10 + i] * 5, "sampling_params": {"max_tokens": max_tokens}, "request_id": f"cmpl-1-{i}"}
        )
        for i in range(prompts)
    ]
    body = {"model": "tiny", "prompt": ["x"] * prompts, "max_tokens": max_tokens}
    return TokenizedRequest(OpenAIRequest(Pipeline.COMPLETIONS, body), "cmpl-1", rendered)


def test_a_batch_under_handoff_is_a_prefill_and_a_decode_leg_per_prompt() -> None:
    pd = planner([])
    plan = pd.place(batch(3), b"{}")
    assert isinstance(plan, Owned) and len(plan.legs) == 3
    for index, leg in enumerate(plan.legs):
        assert (leg.role, leg.lease_id, leg.hosts[0]) == (Role.DECODE, f"cmpl-1-{index}", DECODE)
        assert leg.prefill is not None and leg.prefill.lease_id == f"cmpl-1-{index}-prefill-0"
        assert leg.prefill.hosts[0] == PREFILL and leg.prefill.max_tokens == 1
    ledger = pd.scheduler.ledger
    # prefill charges each prompt and one token, decode the generated tokens only
    assert (ledger.active_tokens(PREFILL), ledger.active_tokens(DECODE)) == (3 * 6, 3 * 4)
    for leg in plan.legs:
        assert leg.prefill is not None
        pd.finish(leg.prefill.lease_id)
        pd.finish(leg.lease_id)
    assert ledger.total_tokens == 0


def test_a_batch_that_does_not_fit_gives_every_lease_back() -> None:
    pd = planner([], admission={"instance_token_budget": 15})  # two prompts' prefill legs fit, not three
    with pytest.raises(GatewayError) as rejected:
        pd.place(batch(3), b"{}")
    assert rejected.value.status == 429 and "no prefill/decode pair available" in rejected.value.message
    assert pd.scheduler.ledger.total_tokens == 0 and pd.scheduler.ledger.active_leases == 0


def test_a_trigger_batch_goes_native_or_is_refused_under_obfuscation() -> None:
    trigger = planner(["concurrent_engine_sync"])
    plan = trigger.place(batch(2), b'{"prompt": ["x", "x"]}')
    assert isinstance(plan, Native) and plan.hosts[0] == DECODE
    trigger.finish(plan.lease_id)
    obfuscated = planner(["concurrent_engine_sync"], obfuscation={"enable": True})
    with pytest.raises(GatewayError) as refused:
        obfuscated.place(batch(2), b"{}")
    assert refused.value.status == 501 and "token obfuscation" in refused.value.message


def test_without_a_pair_the_error_says_so_even_with_every_breaker_closed() -> None:
    pd = planner([])
    pd.scheduler.set_capabilities(PREFILL, "tokenizer mismatch: canary ids differ", token_only=True)
    with pytest.raises(GatewayError) as rejected:
        pd.place(batch(1), b"{}")
    message = rejected.value.message
    assert rejected.value.status == 503 and message.startswith("no prefill/decode pair available: no prefill")
    assert "tokenizer mismatch" in message and "circuit breakers" not in message


def test_panic_routing_is_the_last_resort_after_every_shape() -> None:
    """Prefill breakers open: the prompt is served alone by union, no panic. Union's open too:
    rather than a 503, the pair is placed as if no breaker were open, and the planner says so."""
    pools = [
        {"name": "union", "role": "union", "instances": [{"port": 8200}]},
        {"name": "prefill", "role": "prefill", "instances": [{"port": 8201}]},
        {"name": "decode", "role": "decode", "instances": [{"port": 8202}]},
    ]
    config = TitoConfig.model_validate({"pools": pools, "scheduler": {"prefix_source": "routing"}})
    pd = Planner(config, None, build_scheduler(config))  # type: ignore[arg-type]
    panics: list[str] = []
    pd.on_panic = panics.append

    def open_breaker(address: str) -> None:
        for _ in range(config.scheduler.breaker.failure_threshold):
            pd.scheduler.breakers[address].record_failure(time.monotonic())

    open_breaker(PREFILL)
    [alone] = pd.place(batch(1), b"{}").legs  # type: ignore[union-attr]
    assert (alone.role, alone.hosts, alone.prefill, panics) == (Role.UNION, (UNION,), None, [])
    open_breaker(UNION)
    [prefill, decode] = pd.place(batch(1), b"{}").legs  # type: ignore[union-attr]
    assert (prefill.role, prefill.hosts, decode.role, decode.hosts) == (
        Role.PREFILL,
        (PREFILL,),
        Role.DECODE,
        (DECODE,),
    )
    assert panics == ["prefill"]
    off = TitoConfig.model_validate(
        {"pools": pools, "scheduler": {"prefix_source": "routing", "breaker": {"panic_when_all_open": False}}}
    )
    strict = Planner(off, None, pd.scheduler)  # type: ignore[arg-type]
    with pytest.raises(GatewayError) as refused:
        strict.place(batch(1), b"{}")
    assert refused.value.status == 503 and "circuit breakers open" in refused.value.message
