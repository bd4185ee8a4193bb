"""From a rendered request to a dispatch decision: breakers, admission, policy, prefix index."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from scheduler.breaker import BreakerConfig, BreakerState, CircuitBreaker
from scheduler.instances import Instance, Pool, Role
from scheduler.ledger import TokenLedger
from scheduler.policies import Candidate, Policy
from scheduler.prefix_index import PrefixIndex


@dataclass(frozen=True)
class ScheduleRequest:
    """What scheduling may look at: the final prompt token ids, never text."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    n: int = 1  # choices: each may generate max_tokens
    other_prompts_demand: int = 0  # the rest of a multi-prompt batch (its prompts + n × max_tokens each)

    @property
    def demand(self) -> int:
        """What admission charges: the prompt plus every token the engine may generate."""
        return len(self.prompt_token_ids) + self.n * self.max_tokens + self.other_prompts_demand


@dataclass(frozen=True)
class Decision:
    request_id: str
    instance: Instance
    fallbacks: tuple[Instance, ...] = field(default=())
    matched_tokens: int = 0

    @property
    def hosts(self) -> tuple[str, ...]:
        """The override_host list for Envoy: chosen instance first, then retry targets."""
        return (self.instance.address, *(f.address for f in self.fallbacks))


@dataclass(frozen=True)
class Rejection:
    status: int  # 429: over budget; 503: no healthy instance
    reason: str


class Scheduler:
    def __init__(
        self,
        pools: list[Pool],
        policy: Policy,
        ledger: TokenLedger | None = None,
        breaker: BreakerConfig | None = None,
        prefix_index: PrefixIndex | None = None,
        max_fallbacks: int = 2,
    ) -> None:
        unions = [p for p in pools if p.role is Role.UNION and p.instances]
        if not unions:
            raise ValueError("a union pool with at least one instance is required")
        self.pool = unions[0]
        self.policy = policy
        self.ledger = ledger or TokenLedger()
        self.prefix_index = prefix_index or PrefixIndex()
        self.max_fallbacks = max_fallbacks
        breaker = breaker or BreakerConfig()
        self.breakers = {i.address: CircuitBreaker(breaker) for i in self.pool.instances}
        # Engines that answered 404/501 to token-only generate: they get native requests only.
        self.token_only_unsupported: set[str] = set()

    def mark_token_only_unsupported(self, address: str) -> None:
        if address in self.breakers:
            self.token_only_unsupported.add(address)

    def supports_token_only(self, address: str) -> bool:
        return address not in self.token_only_unsupported

    def schedule(self, request: ScheduleRequest, now: float) -> Decision | Rejection:
        healthy = [(n, i) for n, i in enumerate(self.pool.instances) if self.breakers[i.address].allows(now)]
        if not healthy:
            return Rejection(503, "no healthy engine instance (all circuit breakers open)")
        demand = request.demand
        if not self.ledger.global_room(demand):
            return Rejection(429, f"gateway token budget exhausted ({demand} tokens requested)")
        roomy = [(n, i) for n, i in healthy if self.ledger.instance_room(i.address, demand)]
        if not roomy:
            return Rejection(429, f"every engine instance is at its token budget ({demand} tokens requested)")
        hashes = self.prefix_index.hashes(request.prompt_token_ids) if self.policy.uses_prefix else []
        matched = self.prefix_index.match(hashes) if hashes else {}
        block = self.prefix_index.block_size
        candidates = [
            Candidate(
                instance=i,
                position=n,
                active_tokens=self.ledger.active_tokens(i.address),
                active_requests=self.ledger.active_requests(i.address),
                matched_tokens=matched.get(i.address, 0) * block,
            )
            for n, i in roomy
        ]
        ranked = self.policy.rank(candidates, len(request.prompt_token_ids))
        chosen = ranked[0]
        self.ledger.acquire(request.request_id, chosen.instance.address, demand)
        self.breakers[chosen.instance.address].on_dispatch()
        if hashes:
            self.prefix_index.record(hashes, chosen.instance.address)
        fallbacks = tuple(c.instance for c in ranked[1 : 1 + self.max_fallbacks])
        return Decision(request.request_id, chosen.instance, fallbacks, chosen.matched_tokens)

    def passthrough_hosts(self) -> tuple[str, ...]:
        """Where a non-inference request (e.g. `/v1/models`) may go: instances with a closed
        breaker, least busy first, else any. It takes no lease and no half-open probe, and its
        outcome is never breaker input."""
        closed = [i for i in self.pool.instances if self.breakers[i.address].state is BreakerState.CLOSED]
        ranked = sorted(closed or self.pool.instances, key=lambda i: self.ledger.active_requests(i.address))
        return tuple(i.address for i in ranked)

    def finish(self, request_id: str, now: float, failed: Iterable[str] = (), served_by: str | None = None) -> None:
        """Release the request's tokens and tell the breakers what the engines did.

        `failed`: instances that failed this request (refused, reset, 5xx); `served_by`: the
        instance that answered. Neither: no engine verdict (e.g. the client left first).
        """
        lease = self.ledger.release(request_id)
        verdict = False
        for address in failed:
            if address in self.breakers:
                self.breakers[address].record_failure(now)
                verdict |= lease is not None and address == lease.address
        if served_by in self.breakers:
            self.breakers[served_by].record_success()
            verdict |= lease is not None and served_by == lease.address
        if lease is not None and not verdict:
            self.breakers[lease.address].record_abandoned()

    def snapshot(self) -> dict[str, Any]:
        return {
            "policy": type(self.policy).__name__,
            "total_active_tokens": self.ledger.total_tokens,
            "active_requests": self.ledger.active_leases,
            "prefix_index_blocks": len(self.prefix_index),
            "instances": {
                i.address: {
                    "active_tokens": self.ledger.active_tokens(i.address),
                    "active_requests": self.ledger.active_requests(i.address),
                    "breaker": self.breakers[i.address].state.value,
                    "consecutive_failures": self.breakers[i.address].failures,
                    "token_only": self.supports_token_only(i.address),
                }
                for i in self.pool.instances
            },
        }
