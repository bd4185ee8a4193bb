from __future__ import annotations

import pytest

from scheduler import Pool, Role, RoundRobin, ScheduleRequest, Scheduler, make_policy


def test_round_robin_cycles_through_the_union_pool() -> None:
    pool = Pool.of("union", Role.UNION, ["a:1", "b:2", "c:3"])
    scheduler = Scheduler([pool], RoundRobin())
    picks = [scheduler.schedule(ScheduleRequest([1, 2], 16)).instance.address for _ in range(7)]
    assert picks == ["a:1", "b:2", "c:3", "a:1", "b:2", "c:3", "a:1"]


def test_a_union_pool_is_required() -> None:
    with pytest.raises(ValueError):
        Scheduler([Pool.of("p", Role.PREFILL, ["a:1"])], RoundRobin())


def test_unknown_policy() -> None:
    with pytest.raises(ValueError):
        make_policy("magic")
