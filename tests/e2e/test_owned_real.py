"""Processor-owned streams on real CPU vLLM engines, through `tito up` and the official
openai client: a batch of prompts fanned out and merged equals native vLLM's answer to the
same batch, streaming and not; and a stream whose engine is killed mid-answer is relayed to
the other engine, the client's text equal to what one engine says alone (temperature 0)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest
from openai import OpenAI

from tests.conftest import RunningStack, free_port, gateway_config, tito_up

PROMPTS = ["The capital of France is", "一二三四五", "def fibonacci(n):"]


def _client(base_url: str) -> OpenAI:
    return OpenAI(
        base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120, http_client=httpx.Client(trust_env=False)
    )


def _batch(base_url: str, stream: bool, **extra: Any) -> tuple[dict[int, str], tuple[int, int]]:
    """Text per choice index, and (prompt, completion) tokens of the whole batch."""
    common: dict[str, Any] = {
        "model": "tiny",
        "prompt": PROMPTS,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 7,
        "n": 2,
        **extra,
    }
    client = _client(base_url)
    if not stream:
        result = client.completions.create(**common)
        assert result.usage is not None
        return {c.index: c.text for c in result.choices}, (result.usage.prompt_tokens, result.usage.completion_tokens)
    texts: dict[int, str] = {}
    usage = (0, 0)
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **common):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
        if chunk.usage is not None:
            usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
    return texts, usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_batch_through_the_gateway_equals_native_vllm(stack: RunningStack, stream: bool) -> None:
    gateway = _batch(stack.base_url, stream)
    native = _batch(stack.engine_url, stream)
    assert sorted(gateway[0]) == list(range(6))
    assert gateway == native


# -- relay -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_engines(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    work = tmp_path_factory.mktemp("relaystack")
    pools = [{"name": "union", "role": "union", "instances": [{"port": free_port()}, {"port": free_port()}]}]
    model = {**stack.config.model.model_dump(), "path": stack.model_path}
    config = gateway_config(
        work / "cache",
        free_port(),
        [],
        stack.model_path,
        pools=pools,
        model=model,
        reschedule={"enable": True},
        scheduler={"policy": "round_robin"},
    )
    with tito_up(work, config) as running:
        yield running


def _engine_groups(stack: RunningStack) -> dict[str, int]:
    """The process group of the engine listening on each instance address (looked up before
    the test: scanning every process's sockets takes seconds here)."""
    ports = {i.port: i.address for pool in stack.config.pools for i in pool.instances}
    listening = psutil.net_connections("tcp")
    return {
        ports[c.laddr.port]: os.getpgid(c.pid)
        for c in listening
        if c.laddr and c.laddr.port in ports and c.status == "LISTEN" and c.pid
    }


def _state(stack: RunningStack) -> dict[str, Any]:
    url = f"http://127.0.0.1:{stack.config.processor.admin_port}/debug/state"
    state: dict[str, Any] = httpx.get(url, timeout=5, trust_env=False).json()
    return state


def _serving(stack: RunningStack) -> str | None:
    active = [a for a, i in _state(stack)["scheduler"]["instances"].items() if i["active_requests"]]
    assert len(active) <= 1, active
    return active[0] if active else None


def test_a_stream_survives_its_engine_dying(two_engines: RunningStack) -> None:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": 1900,  # about 3 s of work: the engine is still generating when it dies
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    text: list[str] = []
    established = threading.Event()  # the engine answered 200: the client has its headers

    def read() -> None:
        stream = _client(two_engines.base_url).completions.create(stream=True, **body)
        established.set()
        for chunk in stream:
            text.extend(c.text for c in chunk.choices)

    groups = _engine_groups(two_engines)
    assert len(groups) == 2
    deadline = time.monotonic() + 10
    while _serving(two_engines) is not None and time.monotonic() < deadline:
        time.sleep(0.05)  # `tito up`'s smoke request gives its lease back just after its answer
    reader = threading.Thread(target=read)
    reader.start()
    # Killed before its headers, an engine is simply skipped for the next one (no relay).
    assert established.wait(30)
    killed = _serving(two_engines)
    assert killed is not None
    time.sleep(0.2)  # mid-answer: about 3 s of work in all
    os.killpg(groups[killed], signal.SIGKILL)  # the engine and its engine-core children
    reader.join(120)
    deadline = time.monotonic() + 5
    while _state(two_engines)["relays"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _state(two_engines)["relays"] == 1
    [survivor] = [i.address for i in two_engines.config.pools[0].instances if i.address != killed]
    native = _client("http://" + survivor).completions.create(**body)
    assert "".join(text) == native.choices[0].text
