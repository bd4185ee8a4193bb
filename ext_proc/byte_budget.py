"""The processor's in-flight byte budget: request bodies being read and engine responses
being buffered, over all streams of the process. A full budget turns new bytes away (503)
instead of letting memory grow with the number of large requests."""

from __future__ import annotations


class ByteBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, n: int) -> bool:
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n


class StreamBytes:
    """One stream's share of the budget, returned in one call on every exit path."""

    def __init__(self, budget: ByteBudget) -> None:
        self._budget = budget
        self.held = 0

    def take(self, n: int) -> bool:
        if not self._budget.take(n):
            return False
        self.held += n
        return True

    def release(self) -> None:
        self._budget.give(self.held)
        self.held = 0
