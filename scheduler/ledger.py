"""Token-based admission: prompt tokens + max_tokens held per request, per instance and overall."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Lease:
    request_id: str
    address: str
    tokens: int


class TokenLedger:
    """Active tokens per instance; budgets of None are unlimited."""

    def __init__(self, global_budget: int | None = None, instance_budget: int | None = None) -> None:
        self.global_budget = global_budget
        self.instance_budget = instance_budget
        self._leases: dict[str, Lease] = {}
        self._tokens: dict[str, int] = {}
        self._requests: dict[str, int] = {}
        self.total_tokens = 0

    def global_room(self, tokens: int) -> bool:
        return self.global_budget is None or self.total_tokens + tokens <= self.global_budget

    def instance_room(self, address: str, tokens: int) -> bool:
        return self.instance_budget is None or self._tokens.get(address, 0) + tokens <= self.instance_budget

    def acquire(self, request_id: str, address: str, tokens: int) -> Lease:
        if request_id in self._leases:
            raise ValueError(f"request {request_id} already holds a lease")
        lease = Lease(request_id, address, tokens)
        self._leases[request_id] = lease
        self._tokens[address] = self._tokens.get(address, 0) + tokens
        self._requests[address] = self._requests.get(address, 0) + 1
        self.total_tokens += tokens
        return lease

    def release(self, request_id: str) -> Lease | None:
        """Idempotent: every exit path may call it."""
        lease = self._leases.pop(request_id, None)
        if lease is not None:
            self._tokens[lease.address] -= lease.tokens
            self._requests[lease.address] -= 1
            self.total_tokens -= lease.tokens
        return lease

    def active_tokens(self, address: str) -> int:
        return self._tokens.get(address, 0)

    def active_requests(self, address: str) -> int:
        return self._requests.get(address, 0)

    @property
    def active_leases(self) -> int:
        return len(self._leases)
