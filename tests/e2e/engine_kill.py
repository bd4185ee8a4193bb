"""Killing a real engine mid-answer, for the relay tests (union and prefill/decode): which
engine serves a stream, its process group, and a reader of the stream on a thread."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil
from openai import OpenAI

from tests.conftest import RunningStack


def client(base_url: str) -> OpenAI:
    return OpenAI(
        base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120, http_client=httpx.Client(trust_env=False)
    )


def engine_groups(stack: RunningStack) -> dict[str, int]:
    """The process group of the engine listening on each instance address (looked up before
    the test: scanning every process's sockets takes seconds here)."""
    ports = {i.port: i.address for pool in stack.config.pools for i in pool.instances}
    listening = psutil.net_connections("tcp")
    return {
        ports[c.laddr.port]: os.getpgid(c.pid)
        for c in listening
        if c.laddr and c.laddr.port in ports and c.status == "LISTEN" and c.pid
    }


def serving_engine(stack: RunningStack) -> str | None:
    """The engine with an active request, per every processor worker's ledger."""
    states = stack.states()
    active = [a for s in states for a, i in s["scheduler"]["instances"].items() if i["active_requests"]]
    assert len(active) <= 1, active
    return active[0] if active else None


def relays(stack: RunningStack) -> int:
    return sum(s["relays"] for s in stack.states())


@dataclass
class Reader:
    """One streamed completion read by the official client on a thread."""

    base_url: str
    body: dict[str, Any]
    text: list[str] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)  # how the stream ended: "done" or the error raised
    started: threading.Event = field(default_factory=threading.Event)  # the first text arrived

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._read)
        self.thread.start()

    def _read(self) -> None:
        try:
            for chunk in client(self.base_url).completions.create(stream=True, **self.body):
                self.text.extend(c.text for c in chunk.choices)
                self.started.set()
            self.ended.append("done")
        except Exception as exc:  # reported by the test's assertions
            self.ended.append(repr(exc))
        self.started.set()

    def drained(self) -> None:
        """Wait until nothing more arrives."""
        count = -1
        while count != len(self.text) and not self.ended:
            count = len(self.text)
            time.sleep(0.3)


SETTLE_S = 4.0


def cut_mid_answer(stack: RunningStack, body: dict[str, Any], attempts: int = 10) -> tuple[str, Reader]:
    """A stream whose engine dies mid-answer: once the client has text, the serving engine is
    stopped (SIGSTOP) and what it already sent drains; if the client's stream has not ended
    then, the rest is frozen inside the engine, and SIGKILL cuts it mid-answer. An engine's
    API server may send a whole answer in one burst: such an attempt ends before the engine
    is stopped and is tried again. Bursts came from unbound EngineCores busy-waiting on the
    API server's core (3 of 4 answers started back to back, 0 of 8 with 3-5 s between);
    `tito up` binds them now (ext_proc/tools/cpu_affinity.py), and every attempt still starts
    after the engines have been idle for SETTLE_S."""
    groups = engine_groups(stack)
    for _ in range(attempts):
        deadline = time.monotonic() + 10
        while serving_engine(stack) is not None and time.monotonic() < deadline:
            time.sleep(0.05)  # the previous answer (or `tito up`'s smoke request) gave its lease back
        time.sleep(SETTLE_S)
        reader = Reader(stack.base_url, body)
        assert reader.started.wait(60)
        serving = serving_engine(stack)
        if serving is None:  # already over
            reader.thread.join(120)
            continue
        os.killpg(groups[serving], signal.SIGSTOP)
        reader.drained()
        if not reader.ended:
            os.killpg(groups[serving], signal.SIGKILL)  # the engine and its engine-core children
            reader.thread.join(120)
            return serving, reader
        os.killpg(groups[serving], signal.SIGCONT)
        reader.thread.join(120)
    raise AssertionError(f"every one of {attempts} answers reached the client whole before its engine was stopped")


def relayed(stack: RunningStack, since: int = 0, timeout: float = 5) -> int:
    """The relays every processor worker counted beyond `since`, once the first one shows
    (or `timeout`)."""
    deadline = time.monotonic() + timeout
    while relays(stack) < since + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    return relays(stack) - since
