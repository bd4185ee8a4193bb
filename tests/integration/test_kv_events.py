"""The KV-event subscriber against vLLM's own ZMQ publisher (the class a CPU engine runs
with --kv-events-config): a subscriber started after the traffic learns the index through
replay, live events update it within one event, and a publisher gone quiet leaves the
instance to routing-time records."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from ext_proc.config import KvEventsEndpoint
from ext_proc.fleet.kv_events import KvEventSubscriber
from scheduler import BlockHasher, KvCacheAffinity, Pool, Role, Scheduler
from tests.conftest import RunningStack, SimGateway, free_port, start_sim_gateway
from tests.engine_sim import vllm_block_stored

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
    return vllm_block_stored(hashes, PROMPT, BLOCK)


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
    subscriber = KvEventSubscriber("a:1", endpoint, scheduler, BLOCK)
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
    task = asyncio.create_task(KvEventSubscriber("a:1", dead, scheduler, BLOCK, timeout_s=0.3).run())
    try:
        await asyncio.sleep(0.6)
        assert scheduler.snapshot(time.monotonic())["instances"]["a:1"]["prefix_source"] == "routing"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# -- through the gateway: real Envoy and render, simulators publishing as vLLM does -----------


def _chat(question: str) -> dict[str, object]:
    return {"model": "tiny", "messages": [{"role": "user", "content": LONG + question}], "max_tokens": 4}


LONG = " ".join(f"Clause {n}: the tenant pays on the first day of each month, 你好." for n in range(40))


def _sources(gateway: SimGateway) -> list[str]:
    instances = gateway.state()["scheduler"]["instances"]
    return [instances[sim.address]["prefix_source"] for sim in gateway.sims]


def _wait_for(check: Callable[[], bool], what: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _log_text(gateway: SimGateway) -> str:
    return gateway.gateway.processes["processor"].log_path.read_text()


def test_a_silent_event_stream_falls_back_to_routing_records_without_failing_a_request(
    stack: RunningStack, tmp_path: Path
) -> None:
    gateway, servers = start_sim_gateway(
        stack,
        tmp_path,
        2,
        kv_events=True,
        scheduler={"policy": "kv_cache_affinity", "kv_events_lag_s": 0.5},
        logging={"format": "json"},
    )
    try:
        _wait_for(lambda: _sources(gateway) == ["kv_events"] * 2, "both instances event-fed")
        url = gateway.base_url + "/v1/chat/completions"
        assert httpx.post(url, json=_chat("First?"), timeout=30, trust_env=False).status_code == 200
        [home] = [n for n, sim in enumerate(gateway.sims) if sim.generate_requests()]
        silent = gateway.sims[home]
        assert silent.kv_events is not None
        silent.kv_events.paused = True  # its publisher goes quiet; the engine still serves

        codes = [httpx.post(url, json=_chat(f"Q{n}?"), timeout=30, trust_env=False).status_code for n in range(4)]
        _wait_for(lambda: _sources(gateway)[home] == "routing", "the silent instance falls back to routing")
        assert codes == [200] * 4
        assert len(silent.generate_requests()) == 5  # the prefix stayed where its blocks are
        assert _sources(gateway)[1 - home] == "kv_events"  # the other one is still event-fed
        fallback = f"KV events of {silent.address}: no event 0.5 s after a request was sent"
        _wait_for(lambda: fallback in _log_text(gateway), "the fallback is logged", 5)

        # While it is silent, its prefixes are recorded at routing time: a new prefix sent to
        # it is found there again (the events would never have said so).
        silent.received.clear()
        for n in range(10):  # new prefixes until one lands on the silent instance
            new_prefix = {**_chat("?"), "messages": [{"role": "user", "content": f"{n} {LONG[:1500]}"}]}
            assert httpx.post(url, json=new_prefix, timeout=30, trust_env=False).status_code == 200
            if silent.generate_requests():
                break
        repeat = httpx.post(url, json=new_prefix, timeout=30, trust_env=False)
        assert repeat.status_code == 200 and len(silent.generate_requests()) == 2

        silent.kv_events.paused = False  # it speaks again: its next event makes it event-fed
        assert httpx.post(url, json=_chat("Back?"), timeout=30, trust_env=False).status_code == 200
        _wait_for(lambda: _sources(gateway) == ["kv_events"] * 2, "event-fed again")
        _wait_for(lambda: f"KV events of {silent.address}: flowing again" in _log_text(gateway), "logged", 5)
        gateway.assert_no_leaks()
    finally:
        gateway.gateway.stop()
        for server in servers:
            server.close()
