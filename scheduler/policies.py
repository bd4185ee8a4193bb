"""Instance selection policies."""

from __future__ import annotations

from typing import Protocol

from scheduler.instances import Instance, Pool


class Policy(Protocol):
    def choose(self, pool: Pool, prompt_token_ids: list[int]) -> Instance: ...


class RoundRobin:
    """Each pool's instances in turn, independent of the request."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def choose(self, pool: Pool, prompt_token_ids: list[int]) -> Instance:
        index = self._next.get(pool.name, 0)
        self._next[pool.name] = (index + 1) % len(pool.instances)
        return pool.instances[index % len(pool.instances)]


def make_policy(name: str) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    raise ValueError(f"unknown scheduling policy {name!r}")
