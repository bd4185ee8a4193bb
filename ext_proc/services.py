"""What every stream of one processor process shares: per base model of the catalog, its
tokenization, derender, planner (scheduler) and capability records (`Services`, one per base);
for the whole process, the HTTP client, byte budget, observability and counters
(`ProcessState`, shared by every base's `Services`)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx
import orjson

from ext_proc.byte_budget import ByteBudget
from ext_proc.config import TitoConfig
from ext_proc.derender.pipeline import Derenderer
from ext_proc.derender.responses import ResponsesServing
from ext_proc.errors import GatewayError
from ext_proc.fleet.capabilities import Capabilities
from ext_proc.fleet.http_client import CountingTransport
from ext_proc.frontend.anthropic_messages import MESSAGES, MessagesFrontend, anthropic_error, family_of
from ext_proc.frontend.model_catalog import models_body, not_found
from ext_proc.frontend.openai_api import parse_body
from ext_proc.frontend.openai_responses import responses_request
from ext_proc.frontend.tokenization import TokenizationService
from ext_proc.legs.prefill import prefilled
from ext_proc.legs.trigger import Triggers
from ext_proc.loop_lag import LoopLag
from ext_proc.obfuscation import TokenCodec
from ext_proc.observability.request import Observability, current
from ext_proc.planning.plan import Local, Plan, TokenOnly
from ext_proc.planning.planner import Planner, token_only_required
from ext_proc.protocol import ApiFamily, ApiKind
from ext_proc.response_handlers import Outs, error_answer, replay_native
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
    capabilities: Capabilities | None = None  # capability negotiation (off: None)
    observability: Observability = field(default_factory=Observability)
    loop_lag: LoopLag = field(default_factory=LoopLag)
    process: ProcessState = field(default_factory=ProcessState)
    responses: ResponsesServing | None = None  # OpenAI Responses answers (None: not served)
    messages: MessagesFrontend = field(init=False)  # Anthropic Messages, converted to chat

    def __post_init__(self) -> None:
        self.messages = MessagesFrontend(self.tokenization.pool, self.config.model.served_name)
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

    async def plan(self, handler: str, content_type: str | None, raw: bytes, request_id: str) -> tuple[Services, Plan]:
        """The request's base model (its services serve it from here on) and its plan."""
        api = ApiKind.from_handler(handler)
        assert api is not None
        try:
            body = parse_body(content_type, raw)
        except GatewayError as error:
            return self, Local(error.status, error.body)
        if family_of(handler) is ApiFamily.MESSAGES:
            return await self._plan_messages(handler, body, request_id)
        if api is ApiKind.RESPONSES:
            return await self._plan_responses(body, raw, request_id)
        try:
            base = self.base_for(body.get("model"))
        except GatewayError as error:
            return self, Local(error.status, error.body)
        return base, await base.planner.plan(api, body, raw, request_id)

    async def _plan_messages(self, handler: str, body: dict[str, Any], request_id: str) -> tuple[Services, Plan]:
        """A Messages request: its chat request planned as chat; what the route refuses is in
        Anthropic's envelope (a body vLLM's model refuses keeps native's validation error)."""
        base = self
        try:
            base = self.base_for(body.get("model"))
        except GatewayError as error:
            return self, Local(error.status, anthropic_error(error.status, error.body))
        try:
            chat = await base.messages.chat_body(body, count_tokens=handler == "messages_count_tokens")
        except GatewayError as error:  # its body is native's already
            return base, Local(error.status, error.body)
        raw = orjson.dumps(chat)
        if handler == "messages_count_tokens":
            plan: Plan = await base.planner.count_tokens(chat, raw, request_id)
        else:
            plan = await base.planner.plan(ApiKind.CHAT, chat, raw, request_id, ApiFamily.MESSAGES, MESSAGES)
        if isinstance(plan, Local) and plan.status != 200:
            plan = Local(plan.status, anthropic_error(plan.status, plan.body))
        return base, plan

    async def _plan_responses(self, body: dict[str, Any], raw: bytes, request_id: str) -> tuple[Services, Plan]:
        """A Responses request: refused as native refuses it without a store, else rendered as
        such and served as the completions request it then is (`derender/responses.py`)."""
        try:
            base = self.base_for(body.get("model"))
            client = await responses_request(raw, request_id)
        except GatewayError as error:
            return self, Local(error.status, error.body)
        if base.responses is None:
            refused = GatewayError(501, "the Responses API is not served by this gateway", code="unsupported")
            return base, Local(refused.status, refused.body)
        named = {**body, "request_id": client.request_id}  # render names its prompt with the gateway's id
        inside = partial(base.responses.inside, client=client)
        raw = orjson.dumps(named)
        return base, await base.planner.plan(
            ApiKind.RESPONSES, named, raw, request_id, ApiFamily.RESPONSES, None, inside
        )

    def answer(self, handler: str) -> bytes:
        """What the processor answers itself: health, and /v1/models (every base's catalog)."""
        return b'{"status":"ok"}' if handler == "health" else models_body([b.planner.catalog for b in self.bases])

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
        if isinstance(routed, Local) and converted is not None:  # a failed prefill, in the client's envelope
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
