"""Per-instance circuit breaker, fed only by engine failures (never by render/derender)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    failure_threshold: int = 3
    base_cooldown_s: float = 5.0
    max_cooldown_s: float = 60.0


class CircuitBreaker:
    """Consecutive failures open it; after an exponentially growing cool-down one probe
    request is let through (half-open); its success closes the breaker, its failure reopens it."""

    def __init__(self, config: BreakerConfig) -> None:
        self._config = config
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.cooldown_s = config.base_cooldown_s
        self.opened_at = 0.0
        self.probe_in_flight = False

    def allows(self, now: float) -> bool:
        if self.state is BreakerState.OPEN and now >= self.opened_at + self.cooldown_s:
            self.state = BreakerState.HALF_OPEN
            self.probe_in_flight = False
        if self.state is BreakerState.HALF_OPEN:
            return not self.probe_in_flight
        return self.state is BreakerState.CLOSED

    def is_open(self, now: float) -> bool:
        """Open and still cooling down: no probe would be let through now (nothing changes)."""
        return self.state is BreakerState.OPEN and now < self.opened_at + self.cooldown_s

    def on_dispatch(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self.probe_in_flight = True

    def record_success(self) -> None:
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.cooldown_s = self._config.base_cooldown_s
        self.probe_in_flight = False

    def record_failure(self, now: float) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self._open(now, min(self.cooldown_s * 2, self._config.max_cooldown_s))
            return
        self.failures += 1
        if self.state is BreakerState.CLOSED and self.failures >= self._config.failure_threshold:
            self._open(now, self._config.base_cooldown_s)

    def record_abandoned(self) -> None:
        """The probe ended without an engine verdict (client gone): allow another probe."""
        self.probe_in_flight = False

    def _open(self, now: float, cooldown_s: float) -> None:
        self.state = BreakerState.OPEN
        self.opened_at = now
        self.cooldown_s = cooldown_s
        self.probe_in_flight = False
