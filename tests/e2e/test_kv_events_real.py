"""Scale-out on real CPU vLLM engines (`tito up`: two engines publishing KV cache events, two
processor workers behind Envoy): every worker's prefix index follows what the engines hold,
whichever worker routed the traffic; a prefix-cache reset is forgotten within one event; a
processor started after the traffic learns the same index through replay; a stored Responses
conversation continues on the engine that cached it, whichever worker takes each turn."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from openai import OpenAI

from tests.conftest import RunningStack, free_ports, metric, scrape

BLOCK = 128  # the CPU engines' KV block size (pools[].block_size, passed to them as --block-size)
PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 80  # ~7 full blocks


def _wait(check: Callable[[], Any], what: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.1)
    return value


def _blocks(state: dict[str, Any]) -> dict[str, int]:
    """Per instance, the blocks this processor's index says it holds."""
    return {address: i["prefix_blocks"] for address, i in state["scheduler"]["instances"].items()}


def _served(stack: RunningStack) -> list[float]:
    return [metric(scrape(url + "/metrics"), "tito_requests_total", status="200") for url in stack.admin_urls]


def _worker_of(stack: RunningStack, served_before: list[float]) -> int:
    """The worker that served the request just answered (its count goes up when the request's
    record ends, which may be just after the client has the answer)."""
    changed = _wait(
        lambda: [n for n, (a, b) in enumerate(zip(served_before, _served(stack), strict=True)) if a != b],
        "a worker counted the request",
        5,
    )
    assert len(changed) == 1, changed
    return int(changed[0])


def _engine_counts(stack: RunningStack, name: str) -> dict[str, float]:
    """A counter of every engine's own /metrics (e.g. requests it finished, prefix-cache hits)."""
    return {i.address: metric(scrape(i.url + "/metrics"), name) for i in stack.config.pools[0].instances}


def _complete(stack: RunningStack, question: str) -> tuple[str, int]:
    """One completion through the gateway: its x-request-id and prompt tokens."""
    client = OpenAI(base_url=stack.base_url + "/v1", api_key="-", max_retries=0)
    raw = client.completions.with_raw_response.create(model="tiny", prompt=PROMPT + question, max_tokens=1)
    assert raw.http_response.status_code == 200
    usage = raw.parse().usage
    assert usage is not None
    return raw.headers["x-request-id"], usage.prompt_tokens


def _changed(before: dict[str, float], after: dict[str, float]) -> list[str]:
    return [key for key in after if after[key] != before[key]]


@pytest.fixture(scope="module")
def subscribed(two_engines: RunningStack) -> RunningStack:
    def every_worker_subscribed() -> bool:
        instances = [i for s in two_engines.states() for i in s["scheduler"]["instances"].values()]
        return len(instances) == 4 and all(i["prefix_source"] == "kv_events" for i in instances)

    _wait(every_worker_subscribed, "both workers subscribed to both engines' KV events", 60)
    return two_engines


def test_every_worker_learns_from_the_events_what_the_engines_hold(subscribed: RunningStack) -> None:
    stack = subscribed
    before = [_blocks(s) for s in stack.states()]
    workers, engines = _served(stack), _engine_counts(stack, "vllm:request_success_total")
    _, prompt_tokens = _complete(stack, "First question?")
    worker_a = _worker_of(stack, workers)
    [engine] = _changed(engines, _engine_counts(stack, "vllm:request_success_total"))
    blocks = prompt_tokens // BLOCK  # the prompt's full blocks: what the engine announces
    assert blocks >= 5

    def learnt() -> bool:  # both workers, though only worker A routed it
        return all(_blocks(s)[engine] >= b[engine] + blocks for s, b in zip(stack.states(), before, strict=True))

    _wait(learnt, f"every worker's index holds the prompt's {blocks} blocks on {engine}")

    # The same prefix through the other worker, which never routed it: it lands on that
    # engine, as the engine's own prefix-cache hit, and the worker knew it would.
    hits, engines = (
        _engine_counts(stack, "vllm:prefix_cache_hits_total"),
        _engine_counts(stack, "vllm:request_success_total"),
    )
    for n in range(12):  # Envoy picks the worker: until worker B takes one (1 in 2 each time)
        workers = _served(stack)
        request_id, _ = _complete(stack, f"Question {n}?")
        if _worker_of(stack, workers) != worker_a:
            break
    else:
        raise AssertionError("Envoy never sent a request to the second worker")
    assert _changed(engines, _engine_counts(stack, "vllm:request_success_total")) == [engine]
    assert _engine_counts(stack, "vllm:prefix_cache_hits_total")[engine] - hits[engine] >= blocks * BLOCK
    [generate] = [line for line in stack.stages(request_id) if line["stage"] == "generate"]
    assert generate["instance"] == engine and generate["matched_tokens"] >= blocks * BLOCK


def _turn(stack: RunningStack, url: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """One Responses turn (greedy, no thinking): its answer and the x-request-id it got."""
    body = {"model": "tiny", "temperature": 0.0, "chat_template_kwargs": {"enable_thinking": False}, **body}
    response = httpx.post(url + "/v1/responses", json=body, timeout=60, trust_env=False)
    assert response.status_code == 200, response.text
    return response.json(), response.headers.get("x-request-id", "")


def test_a_stored_conversation_continues_where_its_prefix_is_cached(subscribed: RunningStack) -> None:
    """Turns two and three of a `previous_response_id` chain land on the engine that served the
    first (its prompt is their prefix) and report the cache hits; native vLLM's own store behind
    a plain round robin would not even find the first turn on the other engine."""
    stack = subscribed
    first, request_id = _turn(stack, stack.base_url, {"input": PROMPT + "Why?", "max_output_tokens": 4})
    [generate] = [line for line in stack.stages(request_id) if line["stage"] == "generate"]
    engine, blocks = generate["instance"], first["usage"]["input_tokens"] // BLOCK
    previous = first
    for question in ("And then?", "Why not?"):
        body = {"input": question, "previous_response_id": previous["id"], "max_output_tokens": 4}
        previous, request_id = _turn(stack, stack.base_url, body)
        [generate] = [line for line in stack.stages(request_id) if line["stage"] == "generate"]
        assert generate["instance"] == engine and generate["matched_tokens"] >= blocks * BLOCK
        assert previous["usage"]["input_tokens_details"]["cached_tokens"] >= blocks * BLOCK
    # native: each engine its own store; the first turn on one, the follow-up on the other
    one, other = (i.url for i in stack.config.pools[0].instances)
    native, _ = _turn(stack, one, {"input": PROMPT + "Why?", "max_output_tokens": 4, "store": True})
    lost = httpx.post(
        other + "/v1/responses",
        json={"model": "tiny", "input": "And then?", "previous_response_id": native["id"]},
        timeout=30,
        trust_env=False,
    )
    assert lost.status_code == 404 and "not found" in lost.json()["error"]["message"]


def test_a_prefix_cache_reset_is_forgotten_within_one_event(subscribed: RunningStack) -> None:
    stack = subscribed
    _complete(stack, "Before the reset?")
    holding = _wait(lambda: [a for a, n in _blocks(stack.states()[0]).items() if n >= 7], "an engine holds the prompt")
    for address in holding:
        reset = httpx.post(f"http://{address}/reset_prefix_cache", timeout=30, trust_env=False)
        assert reset.status_code == 200 and reset.json() == {"success": True}, reset.text
        # vLLM publishes an engine's KV events after a scheduler step: an idle engine's
        # AllBlocksCleared leaves with its next request (one too short to fill a block).
        step = {"model": "tiny", "prompt": "Hi", "max_tokens": 1}
        assert httpx.post(f"http://{address}/v1/completions", json=step, timeout=30, trust_env=False).is_success
    _wait(
        lambda: all(_blocks(s)[a] == 0 for s in stack.states() for a in holding),
        "every worker forgot the reset engines' blocks",
        10,
    )


def test_a_processor_started_after_the_traffic_learns_the_same_index(subscribed: RunningStack, tmp_path: Path) -> None:
    stack = subscribed
    _complete(stack, "For the late joiner?")
    _wait(lambda: any(n >= 7 for n in _blocks(stack.states()[0]).values()), "an engine holds the prompt")
    # A third processor, on ports of its own, after all of that traffic (and the reset before).
    port = free_ports(2)
    config = stack.running_config  # with the engines' event endpoints `tito up` gave them
    config["processor"] |= {"port": port, "admin_port": port + 1, "workers": 1, "worker_index": 0}
    path = tmp_path / "late.yaml"
    path.write_text(yaml.safe_dump(config))
    late = subprocess.Popen([sys.executable, "-m", "ext_proc.cli", "--config", str(path), "processor"])
    try:
        url = f"http://127.0.0.1:{port + 1}/debug/state"

        def replayed() -> dict[str, Any] | None:
            try:
                state: dict[str, Any] = httpx.get(url, timeout=2, trust_env=False).json()
            except httpx.HTTPError:
                return None
            fed = all(i["prefix_source"] == "kv_events" for i in state["scheduler"]["instances"].values())
            return state if fed and _blocks(state) == _blocks(stack.states()[0]) else None

        state = _wait(replayed, "the late processor's index equals the workers'", 120)
        assert any(n >= 7 for n in _blocks(state).values())
    finally:
        late.terminate()
        assert late.wait(60) == 0
