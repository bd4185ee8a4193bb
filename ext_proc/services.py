"""What every stream of one processor process shares."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx

from ext_proc.byte_budget import ByteBudget
from ext_proc.config import TitoConfig
from ext_proc.derender.pipeline import Derenderer
from ext_proc.frontend.tokenization import TokenizationService
from ext_proc.legs.capabilities import Capabilities
from ext_proc.legs.http_client import CountingTransport
from ext_proc.legs.prefill import prefilled
from ext_proc.legs.responses import Outs, error_answer, replay_native
from ext_proc.legs.trigger import Triggers
from ext_proc.loop_lag import LoopLag
from ext_proc.obfuscation import TokenCodec
from ext_proc.observability.request import Observability, current
from ext_proc.planning.plan import Plan, TokenOnly
from ext_proc.planning.planner import Planner, token_only_required
from scheduler import Scheduler


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
    active_exchanges: int = 0
    live: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)  # the exchanges, for /debug/state
    native_replays: int = 0
    relays: int = 0  # engine streams replaced mid-answer (reschedule)
    owned_queue_depth_max: int = 0  # the fullest a processor-owned stream's queue got (backpressure)
    draining: bool = False  # SIGTERM: new streams are refused, open ones finish

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
        self.native_replays += 1
        if (record := current()) is not None:
            record.native_replay(address)
        timeout = self.config.listener.stream_idle_timeout_s
        return replay_native(self.http, address, plan.tokenized.request, timeout, end)
