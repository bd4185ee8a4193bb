"""Soaks of an elastic pool under concurrent greedy streams, on `tito up` with real CPU engines.

    python -m tests.bench.fleet_soak scale   # the pool goes 1 -> 3 -> 1 engines (`tito scale`) under 64 streams
    python -m tests.bench.fleet_soak chaos   # one engine of two SIGKILLed 5 times; `tito up` restarts it

Every stream is checked as a client sees it: status 200, a `finish_reason` of `length`, its
usage, exactly one `[DONE]` and no error event; and (scale) its text equal to the same
request answered by an engine natively. Printed: streams, completed, lost (with why), kills,
relays, restarts, how long a new engine took to route after its record appeared, and what
`/debug/state` holds once the streams are over (leaks). Exit status 0 only with nothing lost
and nothing leaked. A CPU engine takes about a minute to start here (under load too: `tito up`'s
engines share one session, so the scheduler shares a core among their tasks): the runs size
for it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil

from ext_proc.config import TitoConfig
from ext_proc.tools.elastic_pool import read_state, request_scale
from ext_proc.tools.local_stack import run_dir
from tests.bench.sse import DONE, events, story_chat
from tests.bench.up import running_up

PROMPTS = 16  # distinct requests, cycled over the streams (each answered natively once)


def body(i: int, max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return story_chat(i, max_tokens, PROMPTS, stream)


@dataclass
class Tally:
    since: float = field(default_factory=time.monotonic)  # (when a loss happened, in the run)
    started: int = 0
    completed: int = 0
    lost: Counter[str] = field(default_factory=Counter)
    texts: dict[int, set[str]] = field(default_factory=dict)  # prompt -> the texts its streams got
    live: dict[str, int] = field(default_factory=dict)  # x-request-id -> chunks received, while it streams


async def one_stream(http: httpx.AsyncClient, url: str, i: int, max_tokens: int, tally: Tally) -> None:
    """One streamed chat, checked chunk by chunk."""
    tally.started += 1
    text, finish, usage, done, error = [], None, None, 0, None
    request_id = ""
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body(i, max_tokens)) as response:
            request_id = response.headers.get("x-request-id", "")
            if response.status_code != 200:  # with what it said (the processor's or Envoy's answer) and when
                said = (await response.aread()).decode(errors="replace")[:100]
                error = f"status {response.status_code} near {round(time.monotonic() - tally.since, -1):g} s: {said}"
            else:
                async for event in events(response):
                    if event == DONE:
                        done += 1
                        continue
                    assert isinstance(event, dict)
                    if "error" in event:
                        error = "error event"
                    if event.get("choices"):
                        tally.live[request_id] = tally.live.get(request_id, 0) + 1
                    for choice in event.get("choices", []):
                        text.append(choice["delta"].get("content") or "")
                        finish = choice.get("finish_reason") or finish
                    usage = event.get("usage") or usage
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}"
    finally:
        tally.live.pop(request_id, None)
    if error is None and done != 1:
        error = f"{done} [DONE]"
    if error is None and (finish != "length" or not usage or usage["completion_tokens"] != max_tokens):
        error = f"finish {finish}, usage {usage}"
    if error is not None:
        tally.lost[error] += 1
        return
    tally.completed += 1
    tally.texts.setdefault(i % PROMPTS, set()).add("".join(text))


async def keep_streaming(url: str, streams: int, max_tokens: int, stop: asyncio.Event, tally: Tally) -> None:
    """`streams` clients, each starting its next stream as the last one ends, until `stop`."""

    async def client(n: int) -> None:
        k = n
        async with httpx.AsyncClient(timeout=600, trust_env=False) as http:
            while not stop.is_set():
                await one_stream(http, url, k, max_tokens, tally)
                k += streams

    await asyncio.gather(*(client(n) for n in range(streams)))


def native_texts(engine: str, max_tokens: int) -> dict[int, str]:
    """Each prompt answered by an engine directly (its own OpenAI route)."""
    out = {}
    for i in range(PROMPTS):
        answer = httpx.post(f"http://{engine}/v1/chat/completions", json=body(i, max_tokens, False), timeout=300)
        out[i] = answer.json()["choices"][0]["message"]["content"]
    return out


# -- the stack --------------------------------------------------------------------------


@dataclass
class Stack:
    config: TitoConfig
    process: Any
    run_dir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.listener.port}"

    def states(self) -> list[dict[str, Any]]:
        """Every processor worker's /debug/state."""
        admins = [f"http://127.0.0.1:{admin}/debug/state" for _, admin in self.config.processor.worker_ports()]
        return [httpx.get(url, timeout=5, trust_env=False).json() for url in admins]

    def routes(self) -> list[str]:
        """The union pool's instances every worker routes to."""
        routed = [{a for a, why in s["pools"]["union"]["instances"].items() if why == "routes"} for s in self.states()]
        return sorted(set.intersection(*routed))

    def listed(self) -> list[str]:
        return list(read_state(self.run_dir).get("union", {}).get("listed", []))  # type: ignore[call-overload]


@contextlib.contextmanager
def tito_up(replicas: int) -> Iterator[Stack]:
    """`tito up` with the elastic local pool, on free ports, in a folder of its own (the tiny
    model is the usual cache's)."""
    from ext_proc.tools.tiny_model import ensure_tiny_model
    from tests.conftest import free_port, free_ports

    work = Path(tempfile.mkdtemp(prefix="fleet-soak-"))
    processor = free_ports(2)
    discovery = {"source": "dns", "name": "engines.tito.test", "port": free_port()}
    discovery["nameserver"] = f"127.0.0.1:{free_port()}"
    config = TitoConfig.model_validate(
        {
            "listener": {
                "port": free_port(),
                "admin_port": free_port(),
                "engine_endpoints_file": str(work / "eds" / "engines.json"),
            },
            "processor": {"port": processor, "admin_port": processor + 1},
            "render_config": {"endpoint": {"port": free_port()}},
            "model": {"path": str(ensure_tiny_model(Path("~/.cache/tito").expanduser()))},
            "pools": [{"name": "union", "discovery": discovery}],
            "reschedule": {"enable": True},  # a stream whose engine dies is relayed to another
            "logging": {"format": "json"},  # (chaos reads which engine serves a stream from its stage lines)
            "local": {"cache_dir": str(work / "cache"), "replicas": replicas, "kv_events_port": free_ports(2)},
        }
    )
    with running_up(config, work) as process:
        stack = Stack(config, process, run_dir(config))
        print(f"tito up: {stack.url}, logs in {stack.run_dir / 'logs'}", flush=True)
        yield stack


def wait(condition: Any, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"{what}: not after {timeout:g} s")
        time.sleep(0.02)
    return time.monotonic() - start


def leaks(stack: Stack, timeout: float = 30) -> dict[str, int]:
    """What the processor still holds once every stream has ended (all zero: nothing leaked)."""
    deadline = time.monotonic() + timeout
    while True:
        states = stack.states()
        held = {
            "active_exchanges": sum(s["active_exchanges"] for s in states),
            "open_http_streams": sum(s["open_http_streams"] for s in states),
            "admitted_tokens": sum(s["scheduler"]["total_active_tokens"] for s in states),
            "active_requests": sum(s["scheduler"]["active_requests"] for s in states),
        }
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.1)


def wait_until_answering(stack: Stack, address: str, tally: Tally, timeout: float) -> int:
    """The streams engine `address` is answering, once one of them is well into its answer:
    a client has its first two chunks (with the engine's `stream_interval` of 16, at least
    17 tokens sent) and it still runs, so a kill breaks a stream the gateway has committed
    to, which it must relay. Counting the engine's own figures is not enough: its running
    requests may be generated to their end and sitting in sockets, or be a new wave still in
    its prefill (killed then, they are retried, not relayed). Which engine serves a stream is
    read from the processor's `generate` stage lines (the log's JSON format)."""
    served_by: dict[str, str] = {}  # x-request-id -> the instance of its latest leg
    warned: deque[bytes] = deque(maxlen=6)  # the processor's last warnings about the engine
    offsets: dict[Path, int] = {}

    def answering() -> list[str]:
        for log in (stack.run_dir / "logs").glob("processor*.log"):
            with log.open("rb") as f:
                f.seek(offsets.get(log, 0))
                lines = f.read().split(b"\n")
                offsets[log] = f.tell() - len(lines[-1])  # a line still being written: read it next time
            for line in lines[:-1]:
                if line.startswith(b"{") and b'"stage":"generate"' in line:
                    record = orjson.loads(line)
                    served_by[record["request_id"]] = record["instance"]
                elif b'"level":"warning"' in line and address.encode() in line:
                    warned.append(line)
        return [r for r, chunks in tally.live.copy().items() if chunks >= 2 and served_by.get(r) == address]

    try:
        wait(answering, timeout, f"a stream well into its answer on {address}")
    except TimeoutError as exc:  # with what each worker's scheduler says of the instances, and why
        instances = [s["scheduler"]["instances"] for s in stack.states()]
        stacks = engine_stacks(address)
        raise TimeoutError(
            f"{exc}: {instances}; the processor's last warnings: {list(warned)}; the engine's stacks:\n{stacks}"
        ) from None
    return len(answering())


def engine_stacks(address: str) -> str:
    """What each process of the engine on `address` is doing (py-spy), for a failure's message:
    an engine that takes requests and answers nothing shows where it waits."""
    try:
        group = engine_group(address)
    except LookupError as error:
        return str(error)
    dumps = []
    for process in psutil.process_iter(["pid", "name"]):
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(process.pid) == group:
                dumps.append(f"== {process.info['name']} {process.pid}\n{_stack(process.pid)}")
    return "\n".join(dumps)


def _stack(pid: int) -> str:
    try:
        spy = subprocess.run(
            [str(Path(sys.executable).with_name("py-spy")), "dump", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=15,
        )
    except subprocess.TimeoutExpired:  # (seen with a process that got no CPU)
        return "py-spy: no stack within 15 s"
    return spy.stdout[-3000:] + spy.stderr[-300:]


def engine_group(address: str) -> int:
    """The process group of the engine listening on `address`."""
    host, port = address.rsplit(":", 1)
    for c in psutil.net_connections("tcp"):
        if c.status == "LISTEN" and c.laddr and c.laddr.ip == host and c.laddr.port == int(port) and c.pid:
            return os.getpgid(c.pid)
    raise LookupError(f"no process listens on {address}")


# -- the scenarios ------------------------------------------------------------------------


async def scale(stack: Stack, streams: int, max_tokens: int, sizes: list[int]) -> dict[str, Any]:
    """The pool goes through `sizes` (e.g. 1, 3, 1) while `streams` clients stream."""
    native = native_texts(stack.listed()[0], max_tokens)
    stop, tally = asyncio.Event(), Tally()
    load = asyncio.create_task(keep_streaming(stack.url, streams, max_tokens, stop, tally))
    await asyncio.sleep(10)
    joins: list[float] = []
    for size in sizes:
        before = set(stack.listed())
        request_scale(stack.run_dir, "union", size)
        deadline = time.monotonic() + 600
        while len(stack.listed()) != size or stack.routes() != sorted(stack.listed()):
            new = set(stack.listed()) - before
            if new:  # its record is there: how long until the gateway routes to it
                joins.append(await asyncio.to_thread(wait, lambda new=new: new <= set(stack.routes()), 30, "route"))
                before |= new
            if time.monotonic() > deadline:
                raise TimeoutError(f"pool not at {size} engines: {read_state(stack.run_dir)}")
            await asyncio.sleep(0.02)
        await asyncio.sleep(10)  # served at this size
    stop.set()
    await load
    unequal = sum(1 for i, texts in tally.texts.items() if texts != {native[i]})
    return {"tally": tally, "joins_s": joins, "unequal_prompts": unequal, "leaks": leaks(stack)}


async def chaos(stack: Stack, streams: int, max_tokens: int, cycles: int, victim: str) -> dict[str, Any]:
    """Engine `victim` (one of two) SIGKILLed `cycles` times under load, each time after
    `tito up` has restarted it and it routes again."""
    kills, back, tally = 0, [], Tally()
    await asyncio.to_thread(wait, lambda: len(stack.routes()) == 2, 900, "both engines route")
    stop = asyncio.Event()
    load = asyncio.create_task(keep_streaming(stack.url, streams, max_tokens, stop, tally))
    on_victim: list[int] = []  # its streams well into their answers when killed (they are relayed)
    for _ in range(cycles):
        await asyncio.sleep(5)  # streams on both
        # (a kill between two of its streams would test nothing)
        on_victim.append(await asyncio.to_thread(wait_until_answering, stack, victim, tally, 60))
        os.killpg(engine_group(victim), signal.SIGKILL)
        kills += 1
        await asyncio.to_thread(wait, lambda: victim not in stack.routes(), 30, "the killed engine held out")
        back.append(await asyncio.to_thread(wait, lambda: victim in stack.routes(), 900, "the engine restarted"))
    await asyncio.sleep(5)
    stop.set()
    await load
    return {
        "tally": tally,
        "kills": kills,
        "on_victim_at_kill": on_victim,
        "restarted_in_s": back,
        "relays": sum(s["relays"] for s in stack.states()),
        "leaks": leaks(stack),
    }


def report(name: str, result: dict[str, Any]) -> bool:
    tally: Tally = result["tally"]
    lost = sum(tally.lost.values())
    print(f"{name}: streams {tally.started}, completed {tally.completed}, lost {lost} {dict(tally.lost)}")
    for key, value in result.items():
        if key != "tally":
            shown = [round(v, 2) for v in value] if isinstance(value, list) else value
            print(f"{name}: {key} {shown}")
    ok = lost == 0 and not any(result["leaks"].values()) and result.get("unequal_prompts", 0) == 0
    print(f"{name}: {'OK' if ok else 'FAILED'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", choices=["scale", "chaos"])
    parser.add_argument("--streams", type=int, help="concurrent streams (scale: 64, chaos: 32)")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--cycles", type=int, default=5, help="chaos: kill-and-restart cycles")
    parser.add_argument("--sizes", type=int, nargs="+", default=[3, 1], help="scale: the sizes after 1")
    args = parser.parse_args(argv)
    if args.scenario == "scale":
        with tito_up(replicas=1) as stack:
            result = asyncio.run(scale(stack, args.streams or 64, args.max_tokens, args.sizes))
    else:
        with tito_up(replicas=2) as stack:
            victim = stack.listed()[0]
            result = asyncio.run(chaos(stack, args.streams or 32, args.max_tokens, args.cycles, victim))
    return 0 if report(args.scenario, result) else 1


if __name__ == "__main__":
    sys.exit(main())
