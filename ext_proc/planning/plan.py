"""What the gateway decided to do with one request: no protos, no I/O.

A `Plan` is one of:
- `Local`: the gateway answers itself (errors, 429, 503);
- `Passthrough`: not inference (`/v1/models`): untouched to an engine, no lease, no verdict;
- `Native`: the client's OpenAI body to an engine's own endpoint (multi-prompt for now, a
  local-tokenizer fallback, an engine without token-only generate);
- `TokenOnly`: token-only generate in one or more legs. Union is one leg; Handoff is a
  prefill leg the processor runs, then the decode leg Envoy routes; Trigger is the decode
  leg alone at first (its engine's callback brings the prefill leg: `legs/trigger.py`);
- `Owned`: token-only generate the processor runs itself and answers with a streamed local
  response: fan-out (one leg per prompt of a batch, merged) and relay (one prompt, moved to
  another instance when its engine fails mid-stream): `legs/fanout.py`, `legs/relay.py`.
  Under Handoff each prompt's decode leg carries the prefill leg that goes first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ext_proc.protocol import Conversion, OpenAIRequest, PromptTokens, TokenizedRequest
from scheduler import Role


@dataclass(frozen=True)
class Local:
    status: int
    body: bytes
    retry_after: int | None = None  # seconds, for a refusal a client may retry (429)
    content_type: str = "application/json"
    # A streaming request's error that native's engine finds while generating: the client
    # gets it inside the stream (200, the error event, [DONE]), as its API's room shows it
    in_stream: bool = False


@dataclass(frozen=True)
class Passthrough:
    hosts: tuple[str, ...]


@dataclass(frozen=True)
class Native:
    request: OpenAIRequest
    body: bytes
    lease_id: str
    hosts: tuple[str, ...]


@dataclass(frozen=True)
class Leg:
    """One engine call of a token-only request."""

    role: Role
    lease_id: str  # the leg's own request id: its admission lease and the engine's X-Request-Id
    hosts: tuple[str, ...]  # chosen instance first, then the ones Envoy may retry on
    prompt: PromptTokens
    max_tokens: int
    # On the processor-owned path, how a decode leg gets its prompt's KV: Handoff runs this
    # prefill leg first; Trigger sends the decode leg first and its engine calls back.
    prefill: Leg | None = None
    trigger: bool = False


@dataclass(frozen=True)
class TokenOnly:
    tokenized: TokenizedRequest
    legs: tuple[Leg, ...]
    kv_params_required: bool = False  # the pool's connector hands KV over through prefill's params
    kv_transfer_params: dict[str, Any] | None = None  # for the routed leg: what prefill returned, or Trigger's
    trigger_attempt: int | None = None  # Trigger: decode goes first; its engine calls back for prefill
    stream_interval: int = 1  # tokens per engine event (`planning/stream_interval.py`)

    @property
    def routed(self) -> Leg:
        """The leg Envoy routes (union or decode); the ones before it the processor runs."""
        return self.legs[-1]

    @property
    def prefill(self) -> Leg | None:
        return self.legs[0] if len(self.legs) > 1 else None


@dataclass(frozen=True)
class Owned:
    tokenized: TokenizedRequest
    legs: tuple[Leg, ...]  # one per prompt, in prompt order; their leases are the fan-out's
    relay: bool = False
    stream_interval: int = 1  # tokens per engine event (`planning/stream_interval.py`)


Plan = Local | Passthrough | Native | TokenOnly | Owned


def lease_ids(plan: Plan) -> list[str]:
    """The leases the exchange gives back when the stream ends (an `Owned` plan's legs are
    the fan-out's: it knows how each ended)."""
    if isinstance(plan, Native):
        return [plan.lease_id]
    if isinstance(plan, TokenOnly):
        return [leg.lease_id for leg in plan.legs]
    return []


def engine_legs(plan: Plan) -> list[tuple[str, str]]:
    """(lease, chosen instance) of every engine call the plan has committed, prefill legs included."""
    if isinstance(plan, Native):
        return [(plan.lease_id, plan.hosts[0])]
    if not isinstance(plan, TokenOnly | Owned):
        return []
    legs = [*plan.legs, *(leg.prefill for leg in plan.legs if leg.prefill is not None)]
    return [(leg.lease_id, leg.hosts[0]) for leg in legs]


def pinned(plan: Plan, addresses: set[str]) -> Plan:
    """The plan without fallbacks on the legs sent to these instances: a LoRA adapter was
    loaded there only, and Envoy's retry elsewhere would meet an engine without it."""

    def pin(leg: Leg) -> Leg:
        prefill = pin(leg.prefill) if leg.prefill is not None else None
        return replace(leg, hosts=leg.hosts[:1] if leg.hosts[0] in addresses else leg.hosts, prefill=prefill)

    if isinstance(plan, Native) and plan.hosts[0] in addresses:
        return replace(plan, hosts=plan.hosts[:1])
    if isinstance(plan, TokenOnly | Owned):
        return replace(plan, legs=tuple(pin(leg) for leg in plan.legs))
    return plan


def conversion(plan: Plan | None) -> Conversion | None:
    """How the client's answer is made from the inner API's (Messages, Responses), if it is."""
    if isinstance(plan, Native):
        return plan.request.conversion
    if isinstance(plan, TokenOnly | Owned):
        return plan.tokenized.request.conversion
    return None


def routed(plan: Plan | None) -> tuple[str | None, tuple[str, ...]]:
    """The lease and hosts of the leg Envoy routes, whose verdict Envoy's headers carry."""
    if isinstance(plan, Native):
        return plan.lease_id, plan.hosts
    if isinstance(plan, TokenOnly):
        return plan.routed.lease_id, plan.routed.hosts
    return None, ()
