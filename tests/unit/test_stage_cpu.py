"""The stage profile (`processor.profile_stages`): each request's event-loop CPU lands in its
own stages, whatever other requests' tasks run in between, and the process's sums count
finished requests only."""

from __future__ import annotations

import asyncio
import time

from ext_proc.observability.request import Observability, clock, mark
from ext_proc.observability.stage_cpu import StageProfile, install


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


async def _request(observability: Observability, work: dict[str, float]) -> dict[str, float]:
    record = observability.begin("r")
    for stage, seconds in work.items():
        mark(stage)
        _spin(seconds / 2)
        await asyncio.sleep(0.01)  # the other request's steps run meanwhile, on the same thread
        _spin(seconds / 2)
    await asyncio.sleep(0.01)
    record.finish()
    assert record.clock is not None
    return record.clock.spent


async def test_each_requests_cpu_lands_in_its_own_stages() -> None:
    observability = Observability(stages=StageProfile())
    install(asyncio.get_running_loop(), clock)
    try:
        a, b = await asyncio.gather(
            asyncio.create_task(_request(observability, {"render": 0.04, "plan": 0.01})),
            asyncio.create_task(_request(observability, {"render": 0.01, "later chunks": 0.06})),
        )
    finally:
        asyncio.get_running_loop().set_task_factory(None)
    assert abs(a["render"] - 0.04) < 0.008 and abs(a["plan"] - 0.01) < 0.008, a
    assert abs(b["render"] - 0.01) < 0.008 and abs(b["later chunks"] - 0.06) < 0.008, b
    assert "later chunks" not in a and "plan" not in b
    assert observability.stages is not None
    totals = observability.stages.totals()
    assert totals["requests"] == 2
    assert abs(totals["stages_s"]["render"] - 0.05) < 0.015


async def test_without_profiling_records_have_no_clock() -> None:
    record = Observability().begin("r")
    mark("render")  # a no-op
    assert record.clock is None and clock() is None
