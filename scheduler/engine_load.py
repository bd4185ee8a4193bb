"""The engines' own load (their Prometheus `/metrics`) combined with the local ledger.

Several processors (replicas, worker processes) share one engine pool. Each one's ledger
holds only the requests it sent itself: a lower bound of an engine's load, exact and current.
The engine's figures count everyone's traffic, but are up to one poll interval old. So per
instance with a fresh sample (younger than `stale_s`), ranking sees the larger of the two,
the sample first brought forward by what this process committed to that instance since the
sample arrived:

    requests = max(ledger requests, running + waiting + requests committed since)
    tokens   = max(ledger tokens, round(kv_usage × kv_capacity_tokens) + tokens committed since)

(tokens: the ledger's alone when the engine reports no KV capacity). Requests that finished
since the sample are not taken off: until the next sample the figure errs high, never below
the ledger. A stale or missing sample (metrics unreachable): the ledger alone. Pure: samples
in, figures out; the caller brings the clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineLoad:
    """One sample of an engine's `/metrics`."""

    running: int
    waiting: int
    kv_usage: float  # 0..1: the share of its KV cache blocks in use
    kv_capacity_tokens: int | None  # blocks × block size; None: not reported
    at: float  # when it was sampled (the scheduler's clock)


class EngineLoads:
    """The latest sample per instance, and what was committed to each since it arrived."""

    def __init__(self, stale_s: float) -> None:
        self.stale_s = stale_s
        self._samples: dict[str, EngineLoad] = {}
        # Running totals (requests, tokens) per instance, and their value when its latest sample
        # arrived: "committed since the sample" is one subtraction, with no per-commit history.
        self._committed: dict[str, tuple[int, int]] = {}
        self._at_sample: dict[str, tuple[int, int]] = {}

    def sampled(self, address: str, load: EngineLoad) -> None:
        self._samples[address] = load
        self._at_sample[address] = self._committed.get(address, (0, 0))

    def forget(self, address: str) -> None:
        """The instance left the pool: its samples and counts go (one that rejoins starts anew)."""
        for table in (self._samples, self._committed, self._at_sample):
            table.pop(address, None)

    def committed(self, address: str, tokens: int) -> None:
        requests, total = self._committed.get(address, (0, 0))
        self._committed[address] = (requests + 1, total + tokens)

    def fresh(self, address: str, now: float) -> EngineLoad | None:
        sample = self._samples.get(address)
        return sample if sample is not None and now - sample.at < self.stale_s else None

    def active(self, address: str, now: float, ledger_tokens: int, ledger_requests: int) -> tuple[int, int]:
        """(active tokens, active requests) of the instance: see the module's rule."""
        sample = self.fresh(address, now)
        if sample is None:
            return ledger_tokens, ledger_requests
        requests, total = self._committed.get(address, (0, 0))
        base_requests, base_tokens = self._at_sample[address]
        requests = max(ledger_requests, sample.running + sample.waiting + requests - base_requests)
        if sample.kv_capacity_tokens is None:
            return ledger_tokens, requests
        tokens = max(ledger_tokens, round(sample.kv_usage * sample.kv_capacity_tokens) + total - base_tokens)
        return tokens, requests

    def describe(self, address: str, now: float) -> dict[str, Any] | None:
        """The latest sample for `/debug/state` (None: never sampled)."""
        sample = self._samples.get(address)
        if sample is None:
            return None
        return {
            "running": sample.running,
            "waiting": sample.waiting,
            "kv_usage": sample.kv_usage,
            "age_s": round(now - sample.at, 3),
        }
