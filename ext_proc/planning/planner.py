"""One request in, one `Plan` out: parse → tokenize → budget → pick → commit.

No protos and no Envoy: the adapter (`envoy_protocol/exchange.py`) hands over the route's
handler, the content type and the body bytes, and turns the plan into Envoy messages. The
only I/O is tokenization (render, or the local tokenizer). Every leg is picked before any is
committed, so a request that cannot be placed takes nothing.

Which topology (RFC Generate 阶段, PD-hybrid): with a prefill and a decode pool, Handoff
(prefill leg, then decode) on a Handoff-capable decode instance; when no healthy pair
exists, a union pool, else a decode instance that may serve alone (`decode_colocation`),
else a 503.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

import orjson

from ext_proc.config import TitoConfig
from ext_proc.errors import GatewayError
from ext_proc.frontend.model_catalog import ModelCatalog, not_found
from ext_proc.frontend.token_only import generate_body
from ext_proc.frontend.tokenization import TokenizationService
from ext_proc.observability.request import current
from ext_proc.planning.budget import PREFILL_MAX_TOKENS, leg_max_tokens
from ext_proc.planning.plan import Leg, Local, Native, Owned, Passthrough, Plan, TokenOnly, engine_legs, pinned
from ext_proc.planning.stream_interval import stream_interval
from ext_proc.protocol import Adapter, OpenAIRequest, PromptTokens, TokenizedRequest
from scheduler import Capability, Decision, Pick, Rejection, Role, Scheduler, ScheduleRequest


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
        self.on_engine_failed: Callable[[str], None] | None = None  # (instance) it failed a leg
        self.loop_lag_ms: Callable[[], float] = lambda: 0.0  # the processor's recent event-loop lag
        # `lora.on_missing: load`: loads an adapter on an instance (fleet/lora.py)
        self.load_adapter: Callable[[str, Adapter], Awaitable[None]] | None = None
        decode = config.pool("decode")
        self.kv_params_required = decode is not None and decode.kv_connector == "nixl"
        # Trigger callbacks reach the processor's admin port, never the public listener.
        self.metaserver = f"http://{config.processor.host}:{config.processor.admin_port}/v1/metaserver"

    def passthrough(self) -> Passthrough:
        return Passthrough(self.scheduler.passthrough_hosts())

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
            return Local(error.status, error.body)
        return await self.placed(tokenized, raw)

    async def rendered(self, request: OpenAIRequest, raw: bytes, request_id: str) -> TokenizedRequest:
        """The request's prompts (GatewayError: refused before anything is admitted)."""
        if self._config.derender.mode == "sidecar":
            _refuse_what_the_sidecar_cannot_derender(request)
        self._resolved(request)
        self._check_adapter(request.adapter)
        return with_adapter(await self._tokenization.tokenize(request, self._as_base(request, raw), request_id))

    async def placed(self, tokenized: TokenizedRequest, raw: bytes) -> Plan:
        """A rendered request admitted and placed (`raw`: its body, for a native leg); what
        cannot be placed is answered locally and takes nothing."""
        record, started = current(), time.perf_counter()
        try:
            plan = await self._load_adapter(self.place(tokenized, raw), tokenized.request.adapter)
        except GatewayError as error:
            if record is not None and error.code in ("token_budget_exceeded", "no_healthy_instance"):
                record.rejected(str(error.code))
            return Local(error.status, error.body)
        if record is not None:
            record.scheduled(started, tokenized.prompt_tokens)
        return plan

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
        now = self._clock()
        batch = len(tokenized.prompts) > 1
        unpaired: Rejection | None = None
        if batch and self._trigger_batch():  # RFC: Trigger batches stay on the native path
            if self._config.obfuscation.enable:
                raise GatewayError(501, TRIGGER_BATCH_OBFUSCATED, code="unsupported_with_obfuscation")
        elif tokenized.complete and (batch or self._relays(tokenized)):
            owned = self._owned(tokenized, now)
            if owned is not None:
                return owned
        elif tokenized.complete:
            pair = self._pair(tokenized, now)
            if isinstance(pair, TokenOnly):
                return pair
            unpaired = pair
        alone = self._alone(self._batch_request(tokenized), now, native_batch=batch)
        if isinstance(alone, Rejection):
            raise rejected(_without_pair(unpaired, alone))
        decision = self._commit_pick(alone)
        if (
            batch  # only a Trigger pool, or an instance without token-only generate, serves a batch natively
            or not tokenized.complete
            or not self.scheduler.supports_token_only(decision.instance.address)
        ):
            if self._config.obfuscation.enable:  # fail closed: a native endpoint gets plaintext
                self.finish(decision.request_id)
                raise token_only_required(decision.instance.address)
            request = tokenized.request.on_native_route()
            body = request.engine_bytes(raw) if request is tokenized.request else orjson.dumps(request.engine_body())
            return Native(request, body, decision.request_id, decision.hosts)
        prompt = tokenized.prompts[0]
        leg = Leg(alone.role, decision.request_id, decision.hosts, prompt, alone.request.max_tokens)
        return TokenOnly(_kept(tokenized), (leg,))

    def _commit_pick(self, pick: Pick) -> Decision:
        """Commit a leg; its request's record learns how much of the prompt the instance held."""
        decision = self.scheduler.commit(pick)
        record = current()
        if record is not None:
            record.committed(decision.request_id, decision.matched_tokens)
        return decision

    @property
    def _pd(self) -> bool:
        return Role.PREFILL in self.scheduler.pools and Role.DECODE in self.scheduler.pools

    def _decode_mode(self, mode: Capability) -> bool:
        """The prefill/decode pools work in this mode (Handoff or Trigger)."""
        return self._pd and any(mode in i.capabilities for i in self.scheduler.pools[Role.DECODE].instances)

    def _trigger_batch(self) -> bool:
        """A batch with nothing but a Trigger pool to serve it: the native path (RFC: Trigger
        多 prompt 流式仍沿用原生链路)."""
        return Role.UNION not in self.scheduler.pools and self._decode_mode(Capability.TRIGGER)

    def _relays(self, tokenized: TokenizedRequest) -> bool:
        """Streaming single-prompt requests are relayed (processor-owned) when reschedule is on:
        a relay under Handoff prefills the replay prompt again, one under Trigger sends it
        decode-first with a new metaserver attempt."""
        return (
            self._config.reschedule.enable
            and tokenized.stream
            and len(tokenized.prompts) == 1
            and (Role.UNION in self.scheduler.pools or self._pd)
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
        under Handoff when a healthy pair exists, else one instance alone (PD-hybrid). A
        relay passes the prompt grown by the committed ids, the budget left and the
        instances that failed."""
        budget = leg_max_tokens(self._config, tokenized, prompt, Role.UNION) if max_tokens is None else max_tokens
        now = self._clock() if now is None else now
        adapter = tokenized.request.adapter
        paired = self._handoff_pair(lease_id, prompt, budget, tokenized.n, now, exclude, adapter)
        if paired is None and len(tokenized.prompts) == 1:  # (a Trigger pool's batches go native)
            paired = self._trigger_leg(lease_id, prompt, budget, tokenized.n, now, exclude, adapter)
        if isinstance(paired, Leg):
            return paired
        alone = self._alone(
            ScheduleRequest(lease_id, prompt.engine_ids, budget, tokenized.n, **_lora(adapter)), now, exclude
        )
        if isinstance(alone, Rejection):
            raise rejected(_without_pair(paired, alone))
        decision = self._commit_pick(alone)
        return Leg(alone.role, decision.request_id, decision.hosts, prompt, budget)

    def _handoff_pair(
        self,
        lease_id: str,
        prompt: PromptTokens,
        budget: int,
        n: int,
        now: float,
        exclude: tuple[str, ...],
        adapter: Adapter | None,
    ) -> Leg | Rejection | None:
        """A prompt's decode leg with the prefill leg that goes first, both committed (the
        decode leg charges no prompt: prefill's leg does); why not; None without Handoff pools."""
        if not self._decode_mode(Capability.HANDOFF):
            return None
        lora = _lora(adapter)
        prefill_request = ScheduleRequest(f"{lease_id}-prefill-0", prompt.engine_ids, PREFILL_MAX_TOKENS, **lora)
        prefill = self.scheduler.pick(prefill_request, now, Role.PREFILL, exclude=exclude)
        if isinstance(prefill, Rejection):
            return prefill
        decode_request = ScheduleRequest(lease_id, prompt.engine_ids, budget, n, charge_prompt=False, **lora)
        decode = self.scheduler.pick(decode_request, now, Role.DECODE, exclude=exclude, needs=Capability.HANDOFF)
        if isinstance(decode, Rejection):
            return decode
        first, second = self._commit_pick(prefill), self._commit_pick(decode)
        prefill_leg = Leg(Role.PREFILL, first.request_id, first.hosts, prompt, PREFILL_MAX_TOKENS)
        return Leg(Role.DECODE, second.request_id, second.hosts, prompt, budget, prefill=prefill_leg)

    def _trigger_leg(
        self,
        lease_id: str,
        prompt: PromptTokens,
        budget: int,
        n: int,
        now: float,
        exclude: tuple[str, ...],
        adapter: Adapter | None,
    ) -> Leg | Rejection | None:
        """A prompt's decode leg under Trigger, committed (its prefill leg is committed when
        the engine calls back); why not; None without a Trigger pool."""
        if not self._decode_mode(Capability.TRIGGER):
            return None
        request = ScheduleRequest(lease_id, prompt.engine_ids, budget, n, charge_prompt=False, **_lora(adapter))
        decode = self.scheduler.pick(request, now, Role.DECODE, exclude=exclude, needs=Capability.TRIGGER)
        if isinstance(decode, Rejection):
            return decode
        decision = self._commit_pick(decode)
        return Leg(Role.DECODE, decision.request_id, decision.hosts, prompt, budget, trigger=True)

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

    def _alone(
        self, request: ScheduleRequest, now: float, exclude: tuple[str, ...] = (), native_batch: bool = False
    ) -> Pick | Rejection:
        """One instance serving the whole request: a union instance, else a decode instance
        that may serve alone, else (`native_batch`: a batch on the native path) a Trigger one."""
        if Role.UNION in self.scheduler.pools:
            return self.scheduler.pick(request, now, Role.UNION, exclude=exclude)
        alone = self.scheduler.pick(request, now, Role.DECODE, exclude=exclude, needs=Capability.COLOCATION)
        if isinstance(alone, Rejection) and native_batch and self._trigger_batch():
            return self.scheduler.pick(request, now, Role.DECODE, exclude=exclude, needs=Capability.TRIGGER)
        return alone

    def _batch_request(self, tokenized: TokenizedRequest) -> ScheduleRequest:
        """Admission charges every prompt of the batch and n × max_tokens for each; the
        first prompt's ids drive instance choice."""
        first, *rest = tokenized.prompts
        n = tokenized.n

        def budget(prompt: PromptTokens) -> int:
            return leg_max_tokens(self._config, tokenized, prompt, Role.UNION)

        others = sum(len(p.token_ids) + n * budget(p) for p in rest)
        lora = _lora(tokenized.request.adapter)
        return ScheduleRequest(tokenized.request_id, first.engine_ids, budget(first), n, others, **lora)

    def _pair(self, tokenized: TokenizedRequest, now: float) -> TokenOnly | Rejection | None:
        """Prefill and decode, when a healthy pair exists (else why not, or None without
        prefill/decode pools: serve alone). Trigger when the decode instance calls back for
        its prefill (the prefill leg is committed only then), else Handoff (the prefill leg
        goes first)."""
        if not self._pd:
            return None
        prompt, rid = tokenized.prompts[0], tokenized.request_id
        max_tokens = leg_max_tokens(self._config, tokenized, prompt, Role.DECODE)
        decode_request = ScheduleRequest(
            f"{rid}-decode",
            prompt.engine_ids,
            max_tokens,
            tokenized.n,
            charge_prompt=False,
            **_lora(tokenized.request.adapter),
        )
        prefill = self._pick_prefill(tokenized, now, attempt=0)
        if isinstance(prefill, Rejection):
            return prefill
        unpaired: Rejection | None = None
        for mode in (Capability.TRIGGER, Capability.HANDOFF):
            if not self._decode_mode(mode):
                continue
            decode = self.scheduler.pick(decode_request, now, Role.DECODE, needs=mode)
            if isinstance(decode, Rejection):
                unpaired = decode
                continue
            if mode is Capability.TRIGGER:
                leg = self._commit(decode, tokenized, max_tokens)
                return TokenOnly(
                    _kept(tokenized), (leg,), kv_transfer_params=self._trigger_params(0), trigger_attempt=0
                )
            legs = (self._commit(prefill, tokenized, PREFILL_MAX_TOKENS), self._commit(decode, tokenized, max_tokens))
            return TokenOnly(_kept(tokenized), legs, kv_params_required=self.kv_params_required)
        return unpaired

    def trigger_prefill(self, plan: TokenOnly) -> Leg | None:
        """The prefill leg a Trigger decode engine called for: picked and committed now."""
        picked = self._pick_prefill(plan.tokenized, self._clock(), plan.trigger_attempt or 0)
        return None if isinstance(picked, Rejection) else self._commit(picked, plan.tokenized, PREFILL_MAX_TOKENS)

    def _pick_prefill(
        self, tokenized: TokenizedRequest, now: float, attempt: int, exclude: tuple[str, ...] = ()
    ) -> Pick | Rejection:
        prompt = tokenized.prompts[0]
        lease_id, lora = f"{tokenized.request_id}-prefill-{attempt}", _lora(tokenized.request.adapter)
        request = ScheduleRequest(lease_id, prompt.engine_ids, PREFILL_MAX_TOKENS, **lora)
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
        alone = self._alone(self._batch_request(plan.tokenized), self._clock())
        if isinstance(alone, Rejection):
            return Local(error.status, error.body)
        decision = self._commit_pick(alone)
        leg = Leg(alone.role, decision.request_id, decision.hosts, plan.tokenized.prompts[0], alone.request.max_tokens)
        return TokenOnly(plan.tokenized, (leg,))

    def finish(self, lease_id: str, failed: tuple[str, ...] = (), served_by: str | None = None) -> None:
        """A leg is over: its tokens go back, its engine's verdict to the breakers (whose
        state changes are reported), and each engine that failed it is reported (capability
        negotiation checks at once whether it is still alive)."""
        breakers = self.scheduler.breakers
        before = {a: breakers[a].state for a in (*failed, served_by) if a in breakers}
        self.scheduler.finish(lease_id, self._clock(), failed, served_by)
        for address, was in before.items():
            if breakers[address].state is not was and self.on_breaker is not None:
                self.on_breaker(address, breakers[address].state.value)
        if self.on_engine_failed is not None:
            for address in failed:
                self.on_engine_failed(address)


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


def _lora(adapter: Adapter | None) -> dict[str, Any]:
    """A leg's LoRA adapter as scheduling sees it (affinity, and the prefix index's keys)."""
    return {} if adapter is None else {"adapter": adapter.name, "adapter_path": adapter.path}


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


def _kept(tokenized: TokenizedRequest) -> TokenizedRequest:
    """What the exchange keeps for the life of the stream: no steering fields, no metadata."""
    return replace(tokenized, request=tokenized.request.kept())


ECHO_NEEDS_IN_PROCESS = (
    "`echo` needs the in-process derender (derender.mode: in_process): the render sidecar's"
    " /derender does not repeat the prompt"
)
IDS_NEED_IN_PROCESS = (
    "`return_tokens_as_token_ids` with logprobs needs the in-process derender (derender.mode: in_process):"
    " the render sidecar's /derender names logprob tokens by their text"
)


def _refuse_what_the_sidecar_cannot_derender(request: OpenAIRequest) -> None:
    if request.echo:
        raise GatewayError(400, ECHO_NEEDS_IN_PROCESS, param="echo", code="unsupported_with_sidecar_derender")
    body = request.body
    if body.get("return_tokens_as_token_ids") and body.get("logprobs") not in (None, False):
        param = "return_tokens_as_token_ids"
        raise GatewayError(400, IDS_NEED_IN_PROCESS, param=param, code="unsupported_with_sidecar_derender")


TRIGGER_BATCH_OBFUSCATED = (
    "multi-prompt requests on a Trigger prefill/decode pool are served by an engine's native endpoint,"
    " which token obfuscation forbids"
)


def _without_pair(unpaired: Rejection | None, alone: Rejection) -> Rejection:
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
