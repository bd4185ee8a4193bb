"""What every stream of one processor process shares: per base model of the catalog, its
tokenization, derender, planner (scheduler) and capability records (`Services`, one per base);
for the whole process, the HTTP client, byte budget, observability and counters
(`ProcessState`, shared by every base's `Services`)."""

from __future__ import annotations

import urllib.parse
import weakref
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from ext_proc.api.body import parse_body
from ext_proc.api.conversations import Conversations
from ext_proc.api.routes import ClientApi, client_apis
from ext_proc.byte_budget import ByteBudget
from ext_proc.config import TitoConfig
from ext_proc.derender.pipeline import Derenderer
from ext_proc.errors import GatewayError
from ext_proc.fleet.capabilities import Capabilities
from ext_proc.fleet.http_client import CountingTransport
from ext_proc.fleet.membership import Membership
from ext_proc.frontend.model_catalog import models_body, not_found
from ext_proc.frontend.tokenization import TokenizationService
from ext_proc.legs.prefill import prefilled
from ext_proc.legs.trigger import Triggers
from ext_proc.loop_lag import LoopLag
from ext_proc.obfuscation import TokenCodec
from ext_proc.observability.request import Observability, current, mark
from ext_proc.planning.plan import Local, Plan, TokenOnly
from ext_proc.planning.planner import Planner
from ext_proc.planning.refusals import token_only_required
from ext_proc.protocol import DATA_PLANE, FLOW, DataPlane, Flow
from ext_proc.response_handlers import Outs, error_answer, replay_native
from ext_proc.tenancy.flows import Tenancy
from scheduler import Scheduler


@dataclass
class ProcessState:
    """What the processor process counts across its base models."""

    bases: list[Services] = field(default_factory=list)  # the catalog's base models, the first is the default
    active_exchanges: int = 0
    live: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)  # the exchanges, for /debug/state
    native_replays: int = 0
    relays: int = 0  # engine streams replaced mid-answer (reschedule)
    owned_queue_depth_max: int = 0  # the fullest a processor-owned stream's queue got (backpressure)
    draining: bool = False  # SIGTERM: new streams are refused, open ones finish


@dataclass
class Services:
    config: TitoConfig
    tokenization: TokenizationService
    derender: Derenderer
    planner: Planner
    http: httpx.AsyncClient
    http_streams: CountingTransport
    inflight: ByteBudget
    triggers: Triggers
    codec: TokenCodec | None = None  # token obfuscation (off: None)
    tokenizer: Any = None  # the engines' tokenizer (derender's; beam search decodes with it)
    capabilities: Capabilities | None = None  # capability negotiation (off: None)
    membership: Membership | None = None  # the engines as they join and leave (build_services sets it)
    tenancy: Tenancy | None = None  # API keys and flows (build_services sets it; shared by every base)
    observability: Observability = field(default_factory=Observability)
    loop_lag: LoopLag = field(default_factory=LoopLag)
    process: ProcessState = field(default_factory=ProcessState)
    # The route table: each handler's client API (empty: the APIs without a derender model)
    apis: dict[str, ClientApi] = field(default_factory=dict)
    # What is kept of answered turns, to continue or retrieve them (the process's, every base's)
    conversations: Conversations = field(default_factory=Conversations)

    def __post_init__(self) -> None:
        if not self.apis:
            self.apis = client_apis(self.planner, self.tokenization.pool, self.config.model, None, self.conversations)
        if not self.process.bases:  # a one-model gateway (and the first base of a catalog)
            self.process.bases.append(self)

    @property
    def bases(self) -> list[Services]:
        return self.process.bases

    def base_for(self, requested: Any) -> Services:
        """The base model a request's `model` names (its name, an alias or one of its
        adapters; none: the first), or native vLLM's 404 naming every base's names."""
        if requested is None:
            return self.bases[0]
        for base in self.bases:
            if base.planner.catalog.serves(requested):
                return base
        raise not_found(str(requested), [name for base in self.bases for name in base.planner.catalog.base_names])

    def flow(self, handler: str, headers: Mapping[str, str]) -> Flow | GatewayError:
        """The request's flow (its tenant, priority and weight), or its refusal in the route's
        API envelope: a missing, unknown or revoked API key (401), or, for a request an engine
        would generate for, a queue full for its band and flow whatever its size (429). That one
        is refused from its headers: a flood the queue turns away is not rendered for nothing."""
        if handler == "health":
            return Flow()
        try:
            flow = Flow() if self.tenancy is None else self.tenancy.flow(headers)
            api = self.apis.get(handler)
            generating = api is not None and handler in api.generating
            if generating and all(base.planner.flow.full_for(flow) for base in self.bases):
                raise self.planner.flow.refused_full(flow.priority)
            return flow
        except GatewayError as error:
            return self._enveloped(handler, error)

    def _enveloped(self, handler: str, error: GatewayError) -> GatewayError:
        api = self.apis.get(handler)
        body = api.error(error.status, error.body) if api is not None else error.body
        return GatewayError(error.status, error.message, body=body, retry_after=error.retry_after)

    async def plan(
        self,
        handler: str,
        content_type: str | None,
        raw: bytes,
        request_id: str,
        plane: DataPlane | None = None,
        flow: Flow | None = None,
    ) -> tuple[Services, Plan]:
        """The request's base model (its services serve it from here on) and its plan, made by
        the route's API; `plane`: what the proxy in front allows (subset, rewrites); `flow`:
        whose share it takes."""
        plane_token, flow_token = DATA_PLANE.set(plane), FLOW.set(flow)
        try:
            return await self._plan(handler, content_type, raw, request_id)
        finally:
            DATA_PLANE.reset(plane_token)
            FLOW.reset(flow_token)

    async def _plan(self, handler: str, content_type: str | None, raw: bytes, request_id: str) -> tuple[Services, Plan]:
        mark("parse")
        try:
            body = await parse_body(content_type, raw)  # native's refusals before any route
        except GatewayError as error:
            return self, Local(error.status, error.body)
        api = self.apis[handler]
        try:
            Tenancy.check_model(FLOW.get() or Flow(), body.get("model"))
            base = self.base_for(body.get("model"))
        except GatewayError as error:
            refused = await api.refused(handler, body, raw, request_id) if error.status == 404 else None
            return self, refused or Local(error.status, api.error(error.status, error.body))
        return base, await base.apis[handler].plan(handler, body, raw, request_id)

    async def bodiless(self, handler: str, content_type: str | None) -> GatewayError:
        """What a request without a body gets: native's answer to an empty one."""
        _, plan = await self.plan(handler, content_type, b"", "")
        assert isinstance(plan, Local)
        return GatewayError(plan.status, "no request body", body=plan.body)

    def answers_itself(self, handler: str) -> bool:
        """Answered by the processor from the request's headers alone: health, the model
        catalog, kept conversations."""
        return handler in ("health", "models") or self.conversations.answers(handler)

    async def answer(self, handler: str, headers: Mapping[str, str], flow: Flow) -> tuple[int, bytes]:
        """Such a request's status and JSON body (/v1/models: every base's catalog)."""
        if handler == "health":
            return 200, b'{"status":"ok"}'
        if handler == "models":
            return 200, models_body([b.planner.catalog for b in self.bases])
        path = headers.get(":path", "")
        found = self.config.listener.route(headers.get(":method", ""), path)
        assert found is not None
        params = {name: urllib.parse.unquote(value) for name, value in found[1].items()}
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
        return await self.conversations.answer(handler, params, query, flow.tenant)

    @property
    def scheduler(self) -> Scheduler:
        return self.planner.scheduler

    async def routable(self, plan: TokenOnly, spawn: Callable[[Coroutine[Any, Any, Any]], Any]) -> Plan:
        """A token-only plan ready for Envoy to route: a Handoff's prefill leg has run (its
        decode leg then carries the KV params; no prefill anywhere: served alone, or the
        error), a Trigger's engine callback is expected."""
        routed: Plan = plan
        if plan.prefill is not None:
            routed = await prefilled(plan, self.planner, self.http, self.config.listener.stream_idle_timeout_s)
        if isinstance(routed, TokenOnly) and routed.trigger_attempt is not None:
            self.triggers.expect(routed, spawn)
        converted = plan.tokenized.request.conversion
        if isinstance(routed, Local) and converted is not None:  # a failed prefill, in the client API's envelope
            routed = Local(routed.status, converted.error(routed.status, routed.body))
        return routed

    def replay_native(self, plan: Plan | None, served_by: str | None, end: bool) -> Outs:
        """The engine has no token-only generate and sent nothing yet: the same request once
        more on its native endpoint, from the processor; remembered for that instance."""
        assert isinstance(plan, TokenOnly)
        address = served_by or plan.routed.hosts[0]
        self.scheduler.mark_token_only_unsupported(address)
        if self.capabilities is not None:  # its record is out of date: the engine changed
            self.capabilities.probe_soon(address)
        if self.config.obfuscation.enable:  # fail closed: the native endpoint would get plaintext
            return error_answer(token_only_required(address), end)
        self.process.native_replays += 1
        if (record := current()) is not None:
            record.native_replay(address)
        timeout = self.config.listener.stream_idle_timeout_s
        return replay_native(self.http, address, plan.tokenized.request, timeout, end)
