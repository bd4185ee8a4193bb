"""From a rendered request to a dispatch decision."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.instances import Instance, Pool, Role
from scheduler.policies import Policy


@dataclass(frozen=True)
class ScheduleRequest:
    """What scheduling may look at: the final prompt token ids, never text."""

    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Decision:
    instance: Instance
    fallbacks: tuple[Instance, ...] = field(default=())


class Scheduler:
    def __init__(self, pools: list[Pool], policy: Policy) -> None:
        unions = [p for p in pools if p.role is Role.UNION and p.instances]
        if not unions:
            raise ValueError("a union pool with at least one instance is required")
        self._union = unions[0]
        self._policy = policy

    def schedule(self, request: ScheduleRequest) -> Decision:
        return Decision(self._policy.choose(self._union, request.prompt_token_ids))
