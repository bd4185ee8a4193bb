"""Processor-only throughput: derendered chunks per second of processor CPU.

Real Envoy + processor + a real vLLM render sidecar (qwen3/hermes parsers) over the engine
simulator at full speed (no delays, a separate process: `python -m tests.engine_sim`, one token
per SSE event). The simulator answers every request with the same scripted tokens, which mean
something to the parsers: reasoning, `</think>`, content (ASCII, CJK, emoji), then one hermes
tool call at the end. K concurrent streaming chat requests (with `tools`) run until R requests
are done; the clients count the SSE chunks they receive (all `data:` events but `[DONE]`), and
/proc gives the CPU seconds every process used meanwhile. Chunks per processor-CPU-second is
the "chunks/s per processor process" figure, printed against the target of 10,000.

Run: `python -m tests.bench.processor_bench [--derender in_process|sidecar] [--concurrency 16]
[--requests 64] [--max-tokens 512]` (from the repository root).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from ext_proc.config import TitoConfig
from ext_proc.tools.bench import WEATHER_TOOL, SseEvents, json_safe
from ext_proc.tools.local_stack import LocalStack, ManagedProcess
from ext_proc.tools.tiny_model import ensure_tiny_model
from render_sidecar.launch import render_command
from tests.bench.gateway_bench import PARSERS, free_port, machine_summary

REPO = Path(__file__).resolve().parents[2]
TARGET_CHUNKS_PER_CPU_S = 10_000
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

REASONING = "Let me think step by step. The user asks about the weather in Paris, so I should call the tool. "
CONTENT = "The weather in Paris is mild in spring: sunny days, a few showers. 你好，世界！ 😀 🚀 "
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


def scripted_tokens(model_path: Path, n: int) -> list[int]:
    """Exactly `n` token ids: ~30% reasoning, `</think>`, content, then one tool call."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_path / "tokenizer.json"))

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    tool = encode(TOOL_CALL) if n >= 4 * len(encode(TOOL_CALL)) else []
    think_end = encode("</think>\n\n")
    reasoning_target = int((n - len(tool)) * 0.3)
    reasoning: list[int] = []
    while len(reasoning) < reasoning_target:
        reasoning += encode(REASONING)
    ids = reasoning[:reasoning_target] + think_end
    piece = encode(CONTENT)
    while len(ids) + len(piece) + len(tool) <= n:  # whole pieces: no character split before the tool call
        ids += piece
    ids += encode(" ") * (n - len(ids) - len(tool))
    return (ids + tool)[:n]


# -- CPU accounting -----------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()  # fields from 3 (state) on; comm may hold spaces


def group_cpu_seconds(pgid: int) -> float:
    """utime + stime of every live process in process group `pgid` (a LocalStack process and
    its children: each runs in its own session)."""
    ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat_fields(int(entry.name))
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / CLOCK_TICKS


def own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


# -- load ---------------------------------------------------------------------------------


@dataclass
class Load:
    chunks: int = 0
    tokens: int = 0
    requests: int = 0
    errors: list[str] = field(default_factory=list)


def chat_body(max_tokens: int, index: int) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"What is the weather in Paris? (request {index})"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": "auto",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
    }


async def _stream(client: httpx.AsyncClient, url: str, max_tokens: int, index: int, load: Load) -> None:
    events = SseEvents()
    chunks = done = 0
    last = b""
    try:
        async with client.stream("POST", url, json=chat_body(max_tokens, index)) as response:
            if response.status_code != 200:
                load.errors.append(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                return
            async for raw in response.aiter_raw():
                for data in events.feed(raw):
                    if data == b"[DONE]":
                        done += 1
                        continue
                    chunks, last = chunks + 1, data
                    if data.startswith(b'{"error"'):
                        load.errors.append(f"request {index}: {data[:300].decode(errors='replace')}")
    except httpx.HTTPError as exc:
        load.errors.append(f"{type(exc).__name__}: {exc}")
        return
    usage = orjson.loads(last).get("usage") if last else None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if done != 1 or tokens != max_tokens:
        load.errors.append(f"request {index}: {done} [DONE], completion_tokens {tokens} (expected {max_tokens})")
    load.chunks += chunks
    load.tokens += tokens or 0
    load.requests += 1


async def drive(base_url: str, concurrency: int, requests: int, max_tokens: int, first_index: int = 0) -> Load:
    """`concurrency` workers keep a stream open each until `requests` streams are done."""
    load = Load()
    queue = iter(range(first_index, first_index + requests))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(trust_env=False, limits=limits, timeout=httpx.Timeout(600.0)) as client:

        async def worker() -> None:
            for index in queue:
                await _stream(client, base_url + "/v1/chat/completions", max_tokens, index, load)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return load


# -- the run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    derender: str
    concurrency: int
    requests: int
    max_tokens: int
    wall_s: float
    chunks: int
    tokens: int
    cpu_s: dict[str, float]
    errors: list[str]
    loop_lag: dict[str, Any]  # the processor's own /debug/state after the run

    @property
    def chunks_per_s(self) -> float:
        return self.chunks / self.wall_s

    @property
    def chunks_per_processor_cpu_s(self) -> float:
        cpu = self.cpu_s["processor"]
        return self.chunks / cpu if cpu > 0 else float("nan")

    @property
    def engine_chunks_per_processor_cpu_s(self) -> float:
        """Engine SSE events (one token each) the processor took in per CPU second."""
        cpu = self.cpu_s["processor"]
        return self.tokens / cpu if cpu > 0 else float("nan")

    def report(self) -> str:
        lines = [
            f"processor-only throughput: derender {self.derender}, qwen3 + hermes parsers, {self.concurrency} "
            f"concurrent streams, {self.requests} requests x {self.max_tokens} tokens (engine simulator, no delays)",
            f"clients received {self.chunks} chunks ({self.tokens} tokens) in {self.wall_s:.2f} s: "
            f"{self.chunks_per_s:.0f} chunks/s",
            "CPU seconds during the run (share of one core):",
        ]
        for name, cpu in self.cpu_s.items():
            lines.append(f"  {name:<15}{cpu:>8.2f} s  {cpu / self.wall_s:>6.0%}")
        target = TARGET_CHUNKS_PER_CPU_S
        per_cpu = self.chunks_per_processor_cpu_s
        engine_per_cpu = self.engine_chunks_per_processor_cpu_s
        lines.append(
            f"per processor process: {per_cpu:.0f} client chunks per processor-CPU-second "
            f"({1e6 / per_cpu:.0f} us CPU per client chunk); target {target:,}: {per_cpu / target:.2f}x"
        )
        lines.append(
            f"  engine side: {engine_per_cpu:.0f} engine chunks (= tokens) per processor-CPU-second "
            f"({1e6 / engine_per_cpu:.0f} us per engine chunk; {self.tokens / max(self.chunks, 1):.1f} "
            f"engine chunks per client chunk, coalesced when they queue up); target {target:,}: "
            f"{engine_per_cpu / target:.2f}x"
        )
        lag = self.loop_lag
        lines.append(
            f"processor event loop lag (a 50 ms timer, last minute): p99 {lag.get('p99_ms')} ms, "
            f"max {lag.get('max_ms')} ms: how long any stream may wait behind the others' work"
        )
        lines += [f"error: {e}" for e in self.errors[:5]]
        if len(self.errors) > 5:
            lines.append(f"... {len(self.errors)} errors in all")
        return "\n".join(lines)


class SimGatewayStack:
    """Render sidecar + engine simulator (processes) + processor + Envoy, on free ports."""

    def __init__(self, work_dir: Path, model_path: Path, derender: str) -> None:
        self.sim_port = free_port()
        config = TitoConfig.model_validate(
            {
                "listener": {"port": free_port(), "admin_port": free_port()},
                "processor": {"port": free_port(), "admin_port": free_port()},
                "render_config": {"endpoint": {"port": free_port()}},
                "derender": {"mode": derender},
                "model": {"path": str(model_path), **PARSERS},
                "pools": [{"instances": [{"port": self.sim_port}]}],
                "local": {"cache_dir": str(work_dir)},
            }
        )
        self.stack = LocalStack(config, work_dir)
        self.config = self.stack.config

    @property
    def sim_url(self) -> str:
        return f"http://127.0.0.1:{self.sim_port}"

    def _add(self, name: str, command: list[str], env: dict[str, str]) -> None:
        process = ManagedProcess(name, command, self.stack.work_dir / "logs" / f"{name}.log", env)
        self.stack.processes[name] = process  # stop() and wait_ready() cover it
        process.start()

    def start(self) -> None:
        try:
            offline = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
            command = render_command(self.config.render_config, self.config.model, self.stack.model_path)
            self._add("render", command, offline)
            sim = [sys.executable, "-m", "tests.engine_sim", "--port", str(self.sim_port)]
            self._add("simulator", sim, {"PYTHONPATH": str(REPO)})
            self.stack.start_gateway()
            self.stack.wait_ready()  # render, processor, Envoy
            self._wait_sim()
        except BaseException:
            self.stack.stop()
            raise

    def _wait_sim(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(self.sim_url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or not self.stack.processes["simulator"].alive():
                raise RuntimeError(
                    "the engine simulator did not start:\n" + self.stack.processes["simulator"].log_tail()
                )
            time.sleep(0.2)

    def script(self, tokens: list[int]) -> None:
        httpx.post(
            self.sim_url + "/sim/control", json={"tokens": tokens}, timeout=5, trust_env=False
        ).raise_for_status()

    def pids(self) -> dict[str, int]:
        names = {"processor": "processor", "envoy": "envoy", "render sidecar": "render", "simulator": "simulator"}
        pids = {}
        for label, name in names.items():
            popen = self.stack.processes[name].popen
            assert popen is not None
            pids[label] = popen.pid
        return pids

    def stop(self) -> None:
        self.stack.stop()


def run(gateway: SimGatewayStack, concurrency: int, requests: int, max_tokens: int, derender: str) -> Result:
    gateway.script(scripted_tokens(Path(gateway.stack.model_path), max_tokens))
    base_url = gateway.stack.base_url
    asyncio.run(drive(base_url, min(concurrency, 2), 2, max_tokens, first_index=1_000_000))  # warm-up
    pids = gateway.pids()
    before = {label: group_cpu_seconds(pid) for label, pid in pids.items()}
    own_before = own_cpu_seconds()
    start = time.perf_counter()
    load = asyncio.run(drive(base_url, concurrency, requests, max_tokens))
    wall = time.perf_counter() - start
    cpu = {label: group_cpu_seconds(pid) - before[label] for label, pid in pids.items()}
    cpu["load generator"] = own_cpu_seconds() - own_before
    admin = f"http://127.0.0.1:{gateway.stack.config.processor.admin_port}/debug/state"
    lag: dict[str, Any] = httpx.get(admin, timeout=5, trust_env=False).json().get("event_loop_lag", {})
    return Result(derender, concurrency, requests, max_tokens, wall, load.chunks, load.tokens, cpu, load.errors, lag)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--derender", choices=["in_process", "sidecar"], default="in_process")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, help="streams in all (default: 4 * concurrency)")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--cache-dir", default="~/.cache/tito", help="where the tiny model is (generated if missing)")
    parser.add_argument("--work-dir", help="config and logs (default: a new temporary directory)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    work_dir = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="tito-processor-bench-"))
    gateway = SimGatewayStack(work_dir, ensure_tiny_model(Path(args.cache_dir).expanduser()), args.derender)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    print(f"starting render sidecar, simulator, processor, Envoy (logs in {work_dir / 'logs'}) ...", file=sys.stderr)
    try:
        gateway.start()
        requests = args.requests or 4 * args.concurrency
        result = run(gateway, args.concurrency, requests, args.max_tokens, args.derender)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        gateway.stop()
    if args.json:
        summary = {
            "chunks_per_s": result.chunks_per_s,
            "chunks_per_processor_cpu_s": result.chunks_per_processor_cpu_s,
            "engine_chunks_per_processor_cpu_s": result.engine_chunks_per_processor_cpu_s,
            "target": TARGET_CHUNKS_PER_CPU_S,
            "machine": machine_summary(),
        }
        print(json.dumps(json_safe({**asdict(result), **summary}), indent=2))
    else:
        print(result.report())
        print(machine_summary())
    return 1 if result.errors else 0


if __name__ == "__main__":
    sys.exit(main())
