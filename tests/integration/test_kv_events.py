"""The KV-event subscriber against vLLM's own ZMQ publisher (the class a CPU engine runs
with --kv-events-config): a subscriber started after the traffic learns the index through
replay, live events update it within one event, and a publisher gone quiet leaves the
instance to routing-time records."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest

from ext_proc.config import KvEventsEndpoint
from ext_proc.legs.kv_events import KvEventSubscriber
from scheduler import BlockHasher, KvCacheAffinity, Pool, Role, Scheduler
from tests.conftest import free_port

BLOCK = 16
PROMPT = list(range(1, 6 * BLOCK + 1))
HASHES = BlockHasher(BLOCK).hashes(PROMPT)


@pytest.fixture
def publisher() -> Iterator[tuple[object, KvEventsEndpoint]]:
    from vllm.distributed.kv_events import ZmqEventPublisher

    port, replay = free_port(), free_port()
    engine = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}", topic="kv@a")
    yield engine, KvEventsEndpoint(endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay}")
    engine.shutdown()


def _publish(engine: object, *events: object) -> None:
    from vllm.distributed.kv_events import KVEventBatch

    engine.publish(KVEventBatch(ts=time.time(), events=list(events)))  # type: ignore[attr-defined]


def _stored(hashes: list[int]) -> object:
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=PROMPT[: len(hashes) * BLOCK],
        block_size=BLOCK,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


async def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert condition()


def _source(scheduler: Scheduler, address: str = "a:1") -> str:
    source: str = scheduler.snapshot(time.monotonic())["instances"][address]["prefix_source"]
    return source


async def test_replay_then_live_events_keep_the_index(publisher: tuple[object, KvEventsEndpoint]) -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved

    engine, endpoint = publisher
    scheduler = Scheduler(
        [Pool.of("union", Role.UNION, ["a:1", "b:2"], block_size=BLOCK)], KvCacheAffinity(), prefix_source="kv_events"
    )
    _publish(engine, _stored(HASHES))  # before any subscriber: only the replay can deliver it
    await asyncio.sleep(0.3)
    subscriber = KvEventSubscriber("a:1", endpoint, scheduler)
    task = asyncio.create_task(subscriber.run())
    try:
        # subscribed once the replay is over (the replayed batch may land a moment before)
        await _until(lambda: _source(scheduler) == "kv_events")
        assert scheduler.prefix_index.match(HASHES) == {"a:1": len(HASHES)}
        _publish(engine, BlockRemoved(block_hashes=HASHES[3:], medium="GPU"))  # evicted
        await _until(lambda: scheduler.prefix_index.match(HASHES) == {"a:1": 3})
        _publish(engine, AllBlocksCleared())  # the engine's prefix cache was reset
        await _until(lambda: scheduler.prefix_index.match(HASHES) == {})
        assert subscriber.last_seq == 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert scheduler.snapshot(time.monotonic())["instances"]["a:1"]["prefix_source"] == "routing"


async def test_no_publisher_leaves_the_instance_to_routing_records() -> None:
    scheduler = Scheduler(
        [Pool.of("union", Role.UNION, ["a:1"], block_size=BLOCK)], KvCacheAffinity(), prefix_source="kv_events"
    )
    dead = KvEventsEndpoint(endpoint=f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    task = asyncio.create_task(KvEventSubscriber("a:1", dead, scheduler, timeout_s=0.3).run())
    try:
        await asyncio.sleep(0.6)
        assert scheduler.snapshot(time.monotonic())["instances"]["a:1"]["prefix_source"] == "routing"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
