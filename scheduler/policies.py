"""Instance selection policies: rank the admissible candidates, best first.

The ranking's tail is the fallback list Envoy retries on before the first byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from scheduler.instances import Instance


@dataclass(frozen=True)
class Candidate:
    instance: Instance
    position: int  # index in the pool, for stable tie-breaking
    active_tokens: int
    active_requests: int
    matched_tokens: int = 0  # prompt tokens this instance already holds in its KV cache


class Policy(Protocol):
    uses_prefix: bool

    def rank(self, candidates: list[Candidate], prompt_tokens: int) -> list[Candidate]: ...


class _Rotating:
    """Ranks by `_load`, then by a turn that advances every decision in the candidates' pool
    (one turn per pool: a prefill pick never moves the decode pool's turn), so equal
    candidates take turns instead of the first one always winning."""

    uses_prefix = False

    def __init__(self) -> None:
        self._turns: dict[str, int] = {}

    def _load(self, candidate: Candidate) -> tuple[int, ...]:
        return ()

    def rank(self, candidates: list[Candidate], prompt_tokens: int) -> list[Candidate]:
        pool = candidates[0].instance.pool if candidates else ""
        offset, n = self._turns.get(pool, 0), _pool_size(candidates)
        self._turns[pool] = offset + 1
        return sorted(candidates, key=lambda c: (*self._load(c), (c.position - offset) % n))


class RoundRobin(_Rotating):
    """Each instance in turn, whatever its load."""


class LoadBalance(_Rotating):
    """Least active tokens, then fewest active requests."""

    def _load(self, candidate: Candidate) -> tuple[int, ...]:
        return (candidate.active_tokens, candidate.active_requests)


@dataclass(frozen=True)
class AffinityWeights:
    prefill_load_scale: float = 1.0
    overlap_credit: float = 1.0
    load_weight: float = 1.0
    hit_rate_threshold: float = 0.0


class KvCacheAffinity:
    """Motor's unified score: prefill_load_scale·max(0, ISL − overlap_credit·matched) + load_weight·load,
    lowest first; below the hit-rate threshold it is plain load balance."""

    uses_prefix = True

    def __init__(self, weights: AffinityWeights | None = None) -> None:
        self.weights = weights or AffinityWeights()
        self._load_balance = LoadBalance()

    def rank(self, candidates: list[Candidate], prompt_tokens: int) -> list[Candidate]:
        w = self.weights
        best_hit = max((c.matched_tokens for c in candidates), default=0) / max(prompt_tokens, 1)
        if best_hit <= w.hit_rate_threshold:
            return self._load_balance.rank(candidates, prompt_tokens)

        def score(c: Candidate) -> tuple[float, int]:
            uncached = max(0.0, prompt_tokens - w.overlap_credit * c.matched_tokens)
            return (w.prefill_load_scale * uncached + w.load_weight * c.active_tokens, c.position)

        return sorted(candidates, key=score)


def _pool_size(candidates: list[Candidate]) -> int:
    return max((c.position for c in candidates), default=0) + 1


def make_policy(name: str, weights: AffinityWeights | None = None) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "load_balance":
        return LoadBalance()
    if name == "kv_cache_affinity":
        return KvCacheAffinity(weights)
    raise ValueError(f"unknown scheduling policy {name!r}")
