"""One request in, one `Plan` out: parse → tokenize → budget → pick → commit.

No protos and no Envoy: the adapter (`envoy_protocol/exchange.py`) hands over the route's
handler, the content type and the body bytes, and turns the plan into Envoy messages. The
only I/O is tokenization (render, or the local tokenizer). Every leg is picked before any is
committed, so a request that cannot be placed takes nothing.

Which topology (RFC Generate 阶段, PD-hybrid) is `topology.shapes`: pairs of a prefill and a
decode leg, else one instance alone, in order of preference; both the routed path and the
processor-owned one (a leg per prompt) try them in `_leg`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from functools import partial
from typing import Any, NamedTuple

import orjson

from ext_proc.config import TitoConfig
from ext_proc.errors import GatewayError
from ext_proc.frontend.model_catalog import ModelCatalog, not_found
from ext_proc.frontend.tokenization import TokenizationService
from ext_proc.observability.request import current, mark
from ext_proc.planning.bodies import with_adapter
from ext_proc.planning.budget import PREFILL_MAX_TOKENS, leg_max_tokens
from ext_proc.planning.flow_control import FlowControl
from ext_proc.planning.plan import (
    Leg,
    Local,
    Native,
    Owned,
    Passthrough,
    Plan,
    TokenOnly,
    engine_legs,
    lease_ids,
    pinned,
    routed,
)
from ext_proc.planning.refusals import (
    TRIGGER_BATCH_OBFUSCATED,
    refuse_what_the_sidecar_cannot_derender,
    rejected,
    token_only_required,
    without_pair,
)
from ext_proc.planning.stream_interval import stream_interval
from ext_proc.planning.topology import (
    PER_PROMPT,
    ROUTED,
    Alone,
    Offer,
    Pair,
    Pairing,
    PrefillFirst,
    Shape,
    shapes,
    trigger_batch,
)
from ext_proc.protocol import DATA_PLANE, FLOW, Adapter, OpenAIRequest, PromptTokens, TokenizedRequest
from ext_proc.tenancy.quota import QuotaUnavailable, TokenQuota
from scheduler import Capability, Decision, Pick, Rejection, Role, Scheduler, ScheduleRequest

# Refusals the request's record counts as admission's (a metric by code).
REJECTIONS = (
    "token_budget_exceeded",
    "no_healthy_instance",
    "queue_full",
    "queue_timeout",
    "shed",
    "tenant_quota_exceeded",
)


class Planner:
    def __init__(
        self,
        config: TitoConfig,
        tokenization: TokenizationService,
        scheduler: Scheduler,
        clock: Callable[[], float] = time.monotonic,
        catalog: ModelCatalog | None = None,
    ) -> None:
        self._config = config
        self._tokenization = tokenization
        self.scheduler = scheduler
        self.catalog = catalog or ModelCatalog(config.model)
        self._clock = clock
        self.on_breaker: Callable[[str, str], None] | None = None  # (instance, new state)
        self.on_panic: Callable[[str], None] | None = None  # (role) picked with every breaker open
        self.on_engine_failed: Callable[[str], None] | None = None  # (instance) it failed a leg
        self.loop_lag_ms: Callable[[], float] = lambda: 0.0  # the processor's recent event-loop lag
        # `lora.on_missing: load`: loads an adapter on an instance (fleet/lora.py)
        self.load_adapter: Callable[[str, Adapter], Awaitable[None]] | None = None
        decode = config.pool("decode")
        self.kv_params_required = decode is not None and decode.kv_connector == "nixl"
        # Trigger callbacks reach the processor's admin port, never the public listener.
        self.metaserver = f"http://{config.processor.host}:{config.processor.admin_port}/v1/metaserver"
        admission = config.admission
        saturation = (admission.saturation_kv_cache_usage, admission.saturation_waiting_requests)
        self.flow = FlowControl(
            admission,
            lambda: scheduler.saturated(*saturation, clock()),
            self._give_back_plan,
            budget=lambda: scheduler.ledger.global_budget,
            lease=_holding_lease,
        )
        self.quota: TokenQuota | None = None  # tenants' tokens per minute (server.py sets it with keys on)
        self.on_tenant_tokens: Callable[[str, int], None] = lambda tenant, tokens: None  # (metrics)

    def passthrough(self, within: frozenset[str] | None = None) -> Passthrough:
        """Where a request goes that is not planned (an engine's own route, or a body the
        gateway does not stream here): `within` the gateway's subset, if it names one."""
        return Passthrough(self.scheduler.passthrough_hosts(within))

    def refuses_passthrough(self, headers: Mapping[str, str]) -> GatewayError | None:
        """501 for a POST with token obfuscation on: what the gateway does not render
        (an engine's own routes) an engine would tokenize itself, in plaintext."""
        if headers.get(":method") == "POST" and self._config.obfuscation.enable:
            return GatewayError(501, "not available with token obfuscation on", code="unsupported_with_obfuscation")
        return None

    async def plan(self, request: OpenAIRequest, raw: bytes, request_id: str) -> Plan:
        """A client API's request (its room parsed `raw` into it, for this planner's base
        model) rendered and placed; what is refused on the way is answered locally."""
        try:
            tokenized = await self.rendered(request, raw, request_id)
        except GatewayError as error:
            return Local(error.status, error.body, in_stream=error.in_stream)
        return await self.placed(tokenized, raw)

    async def rendered(self, request: OpenAIRequest, raw: bytes, request_id: str) -> TokenizedRequest:
        """The request's prompts (GatewayError: refused before anything is admitted)."""
        if self._config.derender.mode == "sidecar":
            refuse_what_the_sidecar_cannot_derender(request)
        self._resolved(request)
        self._check_adapter(request.adapter)
        mark("render")
        return with_adapter(await self._tokenization.tokenize(request, self._as_base(request, raw), request_id))

    async def placed(self, tokenized: TokenizedRequest, raw: bytes) -> Plan:
        """A rendered request admitted and placed (`raw`: its body, for a native leg); what
        cannot be placed is answered locally and takes nothing."""
        record, started = current(), time.perf_counter()
        mark("plan")
        tokenized = _scoped(tokenized)
        try:
            plan = await self._admitted(tokenized, raw)
            plan = await self._load_adapter(plan, tokenized.request.adapter)
        except GatewayError as error:
            if record is not None and error.code in REJECTIONS:
                record.rejected(str(error.code))
            return Local(error.status, error.body, error.retry_after)
        if record is not None:
            record.scheduled(started, tokenized.prompt_tokens)
        return plan

    async def _admitted(self, tokenized: TokenizedRequest, raw: bytes) -> Plan:
        """Placed once its tenant's quota and its turn allow (flow control): GatewayError, refused."""
        demand = self._routed_asks(tokenized).alone.demand
        flow = tokenized.flow
        if self.quota is not None and flow.tenant is not None and flow.tokens_per_minute is not None:
            try:
                retry_after = await self.quota.reserve(flow.tenant, demand, flow.tokens_per_minute)
            except QuotaUnavailable:  # Redis down and `tenancy.redis_fail_mode: refuse`
                raise GatewayError(503, "token quotas are unavailable", code="quota_unavailable") from None
            if retry_after is not None:
                message = f"tenant {flow.tenant}'s tokens per minute are used up ({demand} tokens requested)"
                raise GatewayError(429, message, code="tenant_quota_exceeded", retry_after=math.ceil(retry_after))
        plan = await self.flow.admitted(flow, demand, partial(self.place, tokenized, raw))
        if flow.tenant is not None:
            self.on_tenant_tokens(flow.tenant, demand)
        return plan

    def _give_back_plan(self, plan: Plan) -> None:
        """A plan placed for a client that left while it waited: its legs' tokens go back."""
        if isinstance(plan, Owned):
            self._give_back(list(plan.legs))
        for lease in lease_ids(plan):
            self.finish(lease)

    async def counted(self, request: OpenAIRequest, raw: bytes, request_id: str) -> int:
        """The prompt's token count, from render alone, as native counts it: nothing is
        admitted or sent to an engine (GatewayError: refused)."""
        self._resolved(request)
        return (await self._tokenization.tokenize(request, self._as_base(request, raw), request_id)).prompt_tokens

    def _resolved(self, request: OpenAIRequest) -> None:
        """Admission, metrics and stage lines are per model from here on."""
        if (record := current()) is not None:
            record.resolved(request.response_model(self._config.model.served_name))

    def _check_adapter(self, adapter: Adapter | None) -> None:
        """An adapter no instance lists: `lora.on_missing` says whether it is routed anyway
        (the engine may resolve it), loaded (a path is needed) or refused as native refuses
        an unknown model."""
        if adapter is None or self.scheduler.lora.holders(adapter.name):
            return
        on_missing = self._config.lora.on_missing
        if on_missing == "reject" or (on_missing == "load" and adapter.path is None):
            raise not_found(adapter.name, self.catalog.base_names)

    async def _load_adapter(self, plan: Plan, adapter: Adapter | None) -> Plan:
        """`lora.on_missing: load`: every instance the plan chose that does not list the
        adapter loads it before its leg is sent (once: concurrent requests share the load),
        and that leg keeps no fallback (which would not have it). A failed load gives the
        plan's leases back and answers the engine's error."""
        if adapter is None or self.load_adapter is None or self._config.lora.on_missing != "load":
            return plan
        legs = engine_legs(plan)
        missing = {a for _, a in legs if adapter.name not in self.scheduler.lora.registered(a)}
        try:
            for address in sorted(missing):
                await self.load_adapter(address, adapter)
        except GatewayError:
            for lease, _ in legs:
                self.finish(lease)
            raise
        return pinned(plan, missing)

    def _as_base(self, request: OpenAIRequest, raw: bytes) -> bytes:
        """The body render gets: named after the base model (render serves no alias and no
        adapter; adapters share the base's tokenizer and template). Native paths keep `raw`."""
        served_name = self._config.model.served_name
        if request.body.get("model", served_name) == served_name:
            return raw
        return orjson.dumps({**request.body, "model": served_name})

    def place(self, tokenized: TokenizedRequest, raw: bytes) -> Plan:
        """Budget, pick and commit the legs of a tokenized request (GatewayError: answer it),
        and how many tokens each event of its engine streams carries."""
        plan = self._place(tokenized, raw)
        if not isinstance(plan, TokenOnly | Owned) or not tokenized.generate_streams:
            return plan
        k = stream_interval(self._config.derender.stream_interval, self.loop_lag_ms())
        if (record := current()) is not None:
            record.coalesced(k)
        return replace(plan, stream_interval=k) if k > 1 else plan

    def _place(self, tokenized: TokenizedRequest, raw: bytes) -> Plan:
        now, offer = self._clock(), Offer.of(self.scheduler.pools)
        batch = len(tokenized.prompts) > 1
        pairing: Pairing | None = None
        if batch and trigger_batch(offer):  # RFC: Trigger batches stay on the native path
            if self._config.obfuscation.enable:
                raise GatewayError(501, TRIGGER_BATCH_OBFUSCATED, code="unsupported_with_obfuscation")
        elif tokenized.rewritable and (batch or tokenized.request.beam_search or self._relays(tokenized, offer)):
            owned = self._owned(tokenized, now)
            if owned is not None:
                return owned
        elif tokenized.rewritable:
            pairing = ROUTED
        leg = self._leg(shapes(offer, pairing, batch=batch), self._routed_asks(tokenized), now)
        if isinstance(leg, Rejection):
            raise rejected(leg)
        if leg.trigger:  # the decode leg alone: its engine calls back for its prefill leg
            params, decode = self._trigger_params(0), replace(leg, trigger=False)
            return TokenOnly(_kept(tokenized), (decode,), kv_transfer_params=params, trigger_attempt=0)
        if leg.prefill is not None:  # Handoff: the prefill leg goes first
            legs = (leg.prefill, replace(leg, prefill=None))
            return TokenOnly(_kept(tokenized), legs, kv_params_required=self.kv_params_required)
        if (
            batch  # only a Trigger pool, or an instance without token-only generate, serves a batch natively
            or tokenized.request.beam_search  # likewise: that engine runs the search itself
            or not tokenized.rewritable
            or not self.scheduler.supports_token_only(leg.hosts[0])
        ):
            if self._config.obfuscation.enable:  # fail closed: a native endpoint gets plaintext
                self.finish(leg.lease_id)
                raise token_only_required(leg.hosts[0])
            request = tokenized.request.on_native_route()
            body = request.engine_bytes(raw) if request is tokenized.request else orjson.dumps(request.engine_body())
            return Native(request, body, leg.lease_id, leg.hosts)
        return TokenOnly(_kept(tokenized), (leg,))

    def _leg(self, tried: tuple[Shape, ...], asks: _Asks, now: float, exclude: tuple[str, ...] = ()) -> Leg | Rejection:
        """The first of the shapes (`topology.shapes`) that places the prompt, its legs
        committed, or why none did. When none did for want of a healthy instance, the shapes
        once more with panic routing (`scheduler.breaker.panic_when_all_open`): a pool whose
        every breaker is open is routed as if none were, as Envoy does below its healthy panic
        threshold. Only as a last resort, so an open prefill pool still falls to union first."""
        leg = self._first_shape(tried, asks, now, exclude, panic=False)
        if isinstance(leg, Rejection) and leg.status == 503 and self._config.scheduler.breaker.panic_when_all_open:
            return self._first_shape(tried, asks, now, exclude, panic=True)
        return leg

    def _first_shape(
        self, tried: tuple[Shape, ...], asks: _Asks, now: float, exclude: tuple[str, ...], panic: bool
    ) -> Leg | Rejection:
        """One pass over the shapes. The prefill leg is picked once (its refusal ends
        pairing); a refused decode leg falls to the next shape."""
        prefill: Pick | Rejection | None = None
        unpaired: Rejection | None = None
        refused: Rejection | None = None  # the last instance that would have served alone
        for shape in tried:
            if isinstance(shape, Alone):
                picked = self.scheduler.pick(asks.alone, now, shape.role, exclude, shape.needs, panic)
                if isinstance(picked, Rejection):
                    refused = picked
                    continue
                decision = self._commit_pick(picked)
                return Leg(picked.role, decision.request_id, decision.hosts, asks.prompt, asks.alone.max_tokens)
            if isinstance(prefill, Rejection):
                continue  # no prefill leg: no pair
            if prefill is None and (isinstance(shape, PrefillFirst) or shape.mode is Capability.HANDOFF):
                prefill = self.scheduler.pick(asks.prefill, now, Role.PREFILL, exclude, panic=panic)
                if isinstance(prefill, Rejection):
                    unpaired = prefill
                    continue
            if isinstance(shape, Pair):
                decode = self.scheduler.pick(asks.decode, now, Role.DECODE, exclude, shape.mode, panic)
                if not isinstance(decode, Rejection):
                    return self._paired(asks, shape.mode, decode, prefill)
                unpaired = decode
        assert refused is not None, "every topology ends with an instance alone"
        return without_pair(unpaired, refused)

    def _paired(self, asks: _Asks, mode: Capability, decode: Pick, prefill: Pick | None) -> Leg:
        """A pair committed: under Handoff the prefill leg first, then the decode leg that
        carries it; under Trigger the decode leg alone (its engine calls back for prefill)."""
        prefill_leg = None
        if mode is Capability.HANDOFF:
            assert prefill is not None
            first = self._commit_pick(prefill)
            prefill_leg = Leg(Role.PREFILL, first.request_id, first.hosts, asks.prompt, asks.prefill.max_tokens)
        second = self._commit_pick(decode)
        hosts, trigger = second.hosts, mode is Capability.TRIGGER
        return Leg(Role.DECODE, second.request_id, hosts, asks.prompt, asks.decode.max_tokens, prefill_leg, trigger)

    def _commit_pick(self, pick: Pick) -> Decision:
        """Commit a leg; its request's record learns how much of the prompt the instance held."""
        decision = self.scheduler.commit(pick)
        if pick.panic and self.on_panic is not None:
            self.on_panic(pick.role.value)
        record = current()
        if record is not None:
            record.committed(decision.request_id, decision.matched_tokens)
        return decision

    def _relays(self, tokenized: TokenizedRequest, offer: Offer) -> bool:
        """Streaming single-prompt requests are relayed (processor-owned) when reschedule is on:
        a relay under Handoff prefills the replay prompt again, one under Trigger sends it
        decode-first with a new metaserver attempt."""
        return (
            self._config.reschedule.enable
            and tokenized.stream
            and len(tokenized.prompts) == 1
            and (offer.union or offer.pd)
        )

    def _owned(self, tokenized: TokenizedRequest, now: float) -> Owned | None:
        """One leg per prompt, each with its own lease and instance: admitted as the sum of
        the prompts (a rejection gives back what earlier prompts took). None: an instance
        without token-only generate was chosen, so the batch goes native."""
        legs: list[Leg] = []
        try:
            for index, prompt in enumerate(tokenized.prompts):
                legs.append(self.prompt_leg(tokenized, f"{tokenized.request_id}-{index}", prompt, now))
        except GatewayError:
            self._give_back(legs)
            raise
        engines = [leg.hosts[0] for leg in legs] + [leg.prefill.hosts[0] for leg in legs if leg.prefill is not None]
        if not all(self.scheduler.supports_token_only(engine) for engine in engines):
            self._give_back(legs)
            return None
        return Owned(_kept(tokenized), tuple(legs), relay=len(legs) == 1)

    def prompt_leg(
        self,
        tokenized: TokenizedRequest,
        lease_id: str,
        prompt: PromptTokens,
        now: float | None = None,
        max_tokens: int | None = None,
        exclude: tuple[str, ...] = (),
    ) -> Leg:
        """One prompt's legs, committed (GatewayError: rejected): its prefill and decode legs
        under Handoff when a healthy pair exists (else, a single prompt, its Trigger decode
        leg), else one instance alone (PD-hybrid). A relay passes the prompt grown by the
        committed ids, the budget left and the instances that failed."""
        budget = leg_max_tokens(self._config, tokenized, prompt, Role.UNION) if max_tokens is None else max_tokens
        now = self._clock() if now is None else now
        n, scope = tokenized.n, _scope(tokenized)
        decode = ScheduleRequest(lease_id, prompt.engine_ids, budget, n, charge_prompt=False, **scope)
        alone = ScheduleRequest(lease_id, prompt.engine_ids, budget, n, **scope)
        asks = _Asks(prompt, _prefill_request(lease_id, prompt, tokenized, 0), decode, alone)
        tried = shapes(Offer.of(self.scheduler.pools), PER_PROMPT, batch=len(tokenized.prompts) > 1)
        leg = self._leg(tried, asks, now, exclude)
        if isinstance(leg, Rejection):
            raise rejected(leg)
        return leg

    def trigger_plan(self, tokenized: TokenizedRequest, leg: Leg, attempt: int) -> TokenOnly:
        """A processor-owned Trigger decode leg as the plan its engine's callback is matched
        to (`legs/trigger.py`): its prompt alone, the metaserver of this attempt."""
        alone = replace(tokenized, request_id=leg.lease_id, prompts=[leg.prompt])
        return TokenOnly(alone, (leg,), kv_transfer_params=self._trigger_params(attempt), trigger_attempt=attempt)

    def _trigger_params(self, attempt: int) -> dict[str, Any]:
        """Decode first: the engine learns where to call back for its prefill."""
        return {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "metaserver": f"{self.metaserver}?attempt={attempt}",
        }

    def handoff_plan(self, tokenized: TokenizedRequest, leg: Leg) -> TokenOnly:
        """A processor-owned decode leg and its prefill leg as the Handoff plan of its prompt
        alone (what `legs/prefill.py` runs, retries and falls back from)."""
        assert leg.prefill is not None
        alone = replace(tokenized, request_id=leg.lease_id, prompts=[leg.prompt])
        return TokenOnly(alone, (leg.prefill, replace(leg, prefill=None)), kv_params_required=self.kv_params_required)

    def _give_back(self, legs: list[Leg]) -> None:
        for leg in legs:
            self.finish(leg.lease_id)
            if leg.prefill is not None:
                self.finish(leg.prefill.lease_id)

    def _routed_asks(self, tokenized: TokenizedRequest) -> _Asks:
        """The routed path's legs: the whole request on one instance (admission charges every
        prompt of a batch and n × max_tokens for each; the first prompt's ids drive instance
        choice), or its first prompt's prefill and decode legs."""
        first, *rest = tokenized.prompts
        n, rid, scope = tokenized.n, tokenized.request_id, _scope(tokenized)

        def budget(prompt: PromptTokens, role: Role = Role.UNION) -> int:
            return leg_max_tokens(self._config, tokenized, prompt, role)

        others = sum(len(p.token_ids) + n * budget(p) for p in rest)
        alone = ScheduleRequest(rid, first.engine_ids, budget(first), n, others, **scope)
        max_tokens = budget(first, Role.DECODE)
        decode = ScheduleRequest(f"{rid}-decode", first.engine_ids, max_tokens, n, charge_prompt=False, **scope)
        return _Asks(first, _prefill_request(rid, first, tokenized, 0), decode, alone)

    def trigger_prefill(self, plan: TokenOnly) -> Leg | None:
        """The prefill leg a Trigger decode engine called for: picked and committed now."""
        picked = self._pick_prefill(plan.tokenized, self._clock(), plan.trigger_attempt or 0)
        return None if isinstance(picked, Rejection) else self._commit(picked, plan.tokenized, PREFILL_MAX_TOKENS)

    def _pick_prefill(
        self, tokenized: TokenizedRequest, now: float, attempt: int, exclude: tuple[str, ...] = ()
    ) -> Pick | Rejection:
        request = _prefill_request(tokenized.request_id, tokenized.prompts[0], tokenized, attempt)
        return self.scheduler.pick(request, now, Role.PREFILL, exclude=exclude)

    def _commit(self, pick: Pick, tokenized: TokenizedRequest, max_tokens: int) -> Leg:
        decision = self._commit_pick(pick)
        return Leg(pick.role, decision.request_id, decision.hosts, tokenized.prompts[0], max_tokens)

    def next_prefill(self, plan: TokenOnly, tried: tuple[str, ...], attempt: int) -> TokenOnly | None:
        """The plan with its prefill leg on another instance (after a failed attempt), or None."""
        picked = self._pick_prefill(plan.tokenized, self._clock(), attempt, exclude=tried)
        if isinstance(picked, Rejection):
            return None
        return replace(plan, legs=(self._commit(picked, plan.tokenized, PREFILL_MAX_TOKENS), plan.routed))

    def without_prefill(self, plan: TokenOnly, error: GatewayError) -> Plan:
        """Handoff failed before decode (no prefill instance could prefill): its decode lease
        goes back and the request is served alone if anything can (PD-hybrid), else `error`."""
        self.finish(plan.routed.lease_id)
        tried = shapes(Offer.of(self.scheduler.pools), None, batch=False)  # (a Handoff plan has one prompt)
        leg = self._leg(tried, self._routed_asks(plan.tokenized), self._clock())
        return Local(error.status, error.body) if isinstance(leg, Rejection) else TokenOnly(plan.tokenized, (leg,))

    def finish(self, lease_id: str, failed: tuple[str, ...] = (), served_by: str | None = None) -> None:
        """A leg is over: its tokens go back, its engine's verdict to the breakers (whose
        state changes are reported), and each engine that failed it is reported (capability
        negotiation checks at once whether it is still alive)."""
        breakers = self.scheduler.breakers
        before = {a: breakers[a].state for a in (*failed, served_by) if a in breakers}
        self.scheduler.finish(lease_id, self._clock(), failed, served_by)
        self.flow.released(lease_id)  # room for a waiting request
        for address, was in before.items():
            if breakers[address].state is not was and self.on_breaker is not None:
                self.on_breaker(address, breakers[address].state.value)
        if self.on_engine_failed is not None:
            for address in failed:
                self.on_engine_failed(address)


class _Asks(NamedTuple):
    """What each leg that may serve a prompt asks of scheduling, whichever shape serves it."""

    prompt: PromptTokens
    prefill: ScheduleRequest
    decode: ScheduleRequest  # charges no prompt: the prefill leg does
    alone: ScheduleRequest


def _prefill_request(lease_id: str, prompt: PromptTokens, tokenized: TokenizedRequest, attempt: int) -> ScheduleRequest:
    return ScheduleRequest(f"{lease_id}-prefill-{attempt}", prompt.engine_ids, PREFILL_MAX_TOKENS, **_scope(tokenized))


def _scope(tokenized: TokenizedRequest) -> dict[str, Any]:
    """What every leg of the request carries to scheduling: its LoRA adapter (affinity, and
    the prefix index's keys) and the endpoint subset it must stay within."""
    adapter = tokenized.request.adapter
    lora = {} if adapter is None else {"adapter": adapter.name, "adapter_path": adapter.path}
    return {**lora, "within": tokenized.data_plane.within}


def _holding_lease(plan: Plan) -> str | None:
    """The lease that ends a plan's hold on its flow's share: the leg that answers (a
    Handoff's prefill leg ends first), or a fan-out's first."""
    if isinstance(plan, Owned):
        return plan.legs[0].lease_id if plan.legs else None
    return routed(plan)[0]


def _scoped(tokenized: TokenizedRequest) -> TokenizedRequest:
    """The request with what the stream it came on says of it: the data plane's allowances
    and its flow (set around planning by the Envoy exchange)."""
    scope: dict[str, Any] = {}
    if (plane := DATA_PLANE.get()) is not None and plane != tokenized.data_plane:
        scope["data_plane"] = plane
    if (flow := FLOW.get()) is not None and flow != tokenized.flow:
        scope["flow"] = flow
    return replace(tokenized, **scope) if scope else tokenized


def _kept(tokenized: TokenizedRequest) -> TokenizedRequest:
    """What the exchange keeps for the life of the stream: no steering fields, no metadata."""
    return replace(tokenized, request=tokenized.request.kept())
