"""Processor-only throughput: derendered chunks per second of processor CPU.

Real Envoy + processor + a real vLLM render sidecar (qwen3/hermes parsers) over the engine
simulator at full speed (no delays, a separate process: `python -m tests.engine_sim`, one token
per SSE event unless a request asks for more with `stream_interval`). The simulator answers
every request with the same scripted tokens, which mean something to the parsers: reasoning, `</think>`, content (ASCII, CJK, emoji), then one hermes
tool call at the end. K concurrent streaming chat requests (with `tools`) run until R requests
are done; the clients count the SSE chunks they receive (all `data:` events but `[DONE]`), and
/proc gives the CPU seconds every process used meanwhile. Chunks per processor-CPU-second is
the "chunks/s per processor process" figure, printed against the target of 10,000.

Scale-out (`--workers 1 2`): the same load against the processor run as 1 and as 2 worker
processes (`processor.workers`; Envoy balances streams over them), render sidecar and simulator
kept, processor and Envoy restarted for every run. Runs alternate ABBA (1 2 2 1 ...,
`--rounds`) so drift of the machine weighs on both counts alike; per count the median of its
runs. Printed: requests/s and client chunks/s (wall clock), processor CPU seconds (the
supervisor's process group: every worker), chunks per processor-CPU-second, where the CPU went
(every process group), and the ratio N workers / the fewest against the target of 1.7x.

Engine-side coalescing (`--stream-interval 1 auto 4`): the same load at each
`derender.stream_interval`, processor and Envoy restarted for every run; printed per run, then
processor CPU per engine token (the simulator sends k tokens per event as vLLM does) against
the target of 40 us with auto.

Run: `python -m tests.bench.processor_bench [--derender in_process|sidecar] [--concurrency 16]
[--requests 64] [--max-tokens 512] [--workers 1 2 [--rounds 2]] [--stream-interval 1 auto]`
(from the repository root).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from ext_proc.config import TitoConfig
from ext_proc.tools.bench import SseEvents
from ext_proc.tools.bench_report import json_safe
from ext_proc.tools.bench_workload import WEATHER_TOOL
from ext_proc.tools.local_stack import LocalStack, ManagedProcess
from ext_proc.tools.tiny_model import ensure_tiny_model
from render_sidecar.launch import render_command
from tests.bench.cpu_accounting import group_cpu_by_pid, machine_cpu_seconds, own_cpu_seconds
from tests.bench.gateway_bench import PARSERS, free_port, machine_summary
from tests.conftest import free_ports

REPO = Path(__file__).resolve().parents[2]
TARGET_CHUNKS_PER_CPU_S = 10_000
TARGET_SCALE_OUT = 1.7  # requests/s and chunks/s of 2 workers over 1 (the scale-out issue)
TARGET_US_PER_TOKEN = 40  # processor CPU per engine token at 8 streams, stream_interval auto
OUTSIDE_NOISE = 0.10  # other processes' CPU during a run, share of one core, worth a warning

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


def process_label(pid: int, leader: int, workers: int) -> str:
    """`supervisor` (the group's leader; `processor` when it serves alone) or `worker i` (from
    its `--worker i` argument)."""
    if pid == leader:
        return "supervisor" if workers > 1 else "processor"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid {pid}"
    if b"--worker" in argv[:-1]:
        return f"worker {argv[argv.index(b'--worker') + 1].decode()}"
    return f"pid {pid}"


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
    cpu_s: dict[str, float]  # per process group (and the load generator, this process)
    errors: list[str]
    loop_lags: list[dict[str, Any]]  # every worker's own /debug/state after the run
    workers: int = 1
    processor_cpu_s: dict[str, float] = field(default_factory=dict)  # supervisor, worker 0, ...
    machine_cpu_s: float = float("nan")  # busy CPU of the whole machine meanwhile, ours and others'
    stream_interval: int | str = "auto"  # derender.stream_interval of the run

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s

    @property
    def chunks_per_s(self) -> float:
        return self.chunks / self.wall_s

    @property
    def chunks_per_processor_cpu_s(self) -> float:
        cpu = self.cpu_s["processor"]
        return self.chunks / cpu if cpu > 0 else float("nan")

    @property
    def engine_chunks_per_processor_cpu_s(self) -> float:
        """Engine tokens the processor took in per CPU second (one per SSE event at stream_interval 1)."""
        cpu = self.cpu_s["processor"]
        return self.tokens / cpu if cpu > 0 else float("nan")

    @property
    def machine_busy(self) -> float:
        """CPU seconds of the benchmark's processes over what the machine's cores could give in the run."""
        return sum(self.cpu_s.values()) / (self.wall_s * CORES)

    @property
    def outside_cpu_s(self) -> float:
        """Busy CPU of processes outside the benchmark meanwhile (other work on the machine)."""
        return max(0.0, self.machine_cpu_s - sum(self.cpu_s.values()))

    def report(self) -> str:
        workers = f", {self.workers} processor workers" if self.workers > 1 else ""
        lines = [
            f"processor-only throughput: derender {self.derender} (stream_interval {self.stream_interval}), "
            f"qwen3 + hermes parsers{workers}, "
            f"{self.concurrency} concurrent streams, {self.requests} requests x {self.max_tokens} tokens "
            "(engine simulator, no delays)",
            f"clients received {self.chunks} chunks ({self.tokens} tokens) in {self.wall_s:.2f} s: "
            f"{self.chunks_per_s:.0f} chunks/s, {self.requests_per_s:.1f} requests/s",
            "CPU seconds during the run (share of one core):",
        ]
        for name, cpu in self.cpu_s.items():
            lines.append(f"  {name:<15}{cpu:>8.2f} s  {cpu / self.wall_s:>6.0%}")
            if name == "processor" and len(self.processor_cpu_s) > 1:
                for process, own in self.processor_cpu_s.items():
                    lines.append(f"    {process:<13}{own:>8.2f} s  {own / self.wall_s:>6.0%}")
        lines.append(
            f"  all of these: {self.machine_busy:.0%} of the machine's {CORES} cores; other processes on the "
            f"machine meanwhile: {self.outside_cpu_s:.2f} s ({self.outside_cpu_s / self.wall_s:.0%} of one core)"
        )
        target = TARGET_CHUNKS_PER_CPU_S
        per_cpu = self.chunks_per_processor_cpu_s
        engine_per_cpu = self.engine_chunks_per_processor_cpu_s
        lines.append(
            f"per processor process: {per_cpu:.0f} client chunks per processor-CPU-second "
            f"({1e6 / per_cpu:.0f} us CPU per client chunk); target {target:,}: {per_cpu / target:.2f}x"
        )
        lines.append(
            f"  engine side: {engine_per_cpu:.0f} engine tokens per processor-CPU-second "
            f"({1e6 / engine_per_cpu:.0f} us per engine token; {self.tokens / max(self.chunks, 1):.1f} "
            f"tokens per client chunk, coalesced when they queue up); target {target:,}: "
            f"{engine_per_cpu / target:.2f}x"
        )
        for n, lag in enumerate(self.loop_lags):
            which = f" (worker {n})" if len(self.loop_lags) > 1 else ""
            lines.append(
                f"processor event loop lag{which} (a 50 ms timer, last minute): p99 {lag.get('p99_ms')} ms, "
                f"max {lag.get('max_ms')} ms: how long any stream may wait behind the others' work"
            )
        lines += [f"error: {e}" for e in self.errors[:5]]
        if len(self.errors) > 5:
            lines.append(f"... {len(self.errors)} errors in all")
        return "\n".join(lines)


CORES = len(os.sched_getaffinity(0))


def processor_ports(workers: int | None) -> dict[str, int]:
    """`processor` config for `workers` workers (None: the config's default, as before): worker i
    serves gRPC on port + 2i and admin on admin_port + 2i, so one run of 2N free ports,
    gRPC on the even offsets and admin on the odd ones."""
    if workers is None:
        return {"port": free_port(), "admin_port": free_port()}
    first = free_ports(2 * workers)
    return {"port": first, "admin_port": first + 1, "workers": workers}


class SimGatewayStack:
    """Render sidecar + engine simulator (processes) + processor + Envoy, on free ports."""

    def __init__(
        self,
        work_dir: Path,
        model_path: Path,
        derender: str,
        workers: int | None = None,
        stream_interval: int | str = "auto",
    ) -> None:
        self.sim_port = free_port()
        config = TitoConfig.model_validate(
            {
                "listener": {"port": free_port(), "admin_port": free_port()},
                "processor": processor_ports(workers),
                "render_config": {"endpoint": {"port": free_port()}},
                "derender": {"mode": derender, "stream_interval": stream_interval},
                "model": {"path": str(model_path), **PARSERS},
                "pools": [{"instances": [{"port": self.sim_port}]}],
                # The processor subscribes to the simulator's KV cache events (scheduler.prefix_source
                # kv_events by default), which it never publishes: a free port, not vLLM's 5557,
                # so no other stack on this machine feeds it.
                "local": {"cache_dir": str(work_dir), "kv_events_port": free_port()},
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

    def restart_gateway(self, workers: int, stream_interval: int | str | None = None) -> None:
        """Processor (with `workers` workers, and `stream_interval` if given) and Envoy anew, on
        new ports; the render sidecar and the simulator keep running."""
        for name in ("envoy", "processor"):
            process = self.stack.processes.pop(name, None)
            if process is not None:
                process.stop()
        dumped = self.stack.config.model_dump()
        listener = {**dumped["listener"], "port": free_port(), "admin_port": free_port()}
        processor = {**dumped["processor"], **processor_ports(workers)}
        if stream_interval is not None:
            dumped["derender"]["stream_interval"] = stream_interval
        self.stack.config = TitoConfig.model_validate({**dumped, "listener": listener, "processor": processor})
        self.config = self.stack.config
        try:
            self.stack.start_gateway()
            self.stack.wait_ready()
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
    workers = gateway.config.processor.workers
    # warm-up: a couple of streams per worker (Envoy gives each new stream to the least busy one)
    asyncio.run(drive(base_url, min(concurrency, 2 * workers), 2 * workers, max_tokens, first_index=1_000_000))
    pids = gateway.pids()
    before = {label: group_cpu_by_pid(pid) for label, pid in pids.items()}
    own_before, machine_before = own_cpu_seconds(), machine_cpu_seconds()
    start = time.perf_counter()
    load = asyncio.run(drive(base_url, concurrency, requests, max_tokens))
    wall = time.perf_counter() - start
    machine = machine_cpu_seconds() - machine_before
    after = {label: group_cpu_by_pid(pid) for label, pid in pids.items()}
    cpu = {label: sum(after[label].values()) - sum(before[label].values()) for label in pids}
    cpu["load generator"] = own_cpu_seconds() - own_before
    leader = pids["processor"]
    by_process = {
        process_label(pid, leader, workers): seconds - before["processor"].get(pid, 0.0)
        for pid, seconds in sorted(after["processor"].items())
    }
    if workers > 1 and sum(name.startswith("worker ") for name in by_process) != workers:
        raise RuntimeError(f"processor process group {leader}: {sorted(by_process)}, expected {workers} workers")
    lags: list[dict[str, Any]] = [
        httpx.get(f"http://127.0.0.1:{admin}/debug/state", timeout=5, trust_env=False).json().get("event_loop_lag", {})
        for _, admin in gateway.config.processor.worker_ports()
    ]
    return Result(
        derender,
        concurrency,
        requests,
        max_tokens,
        wall,
        load.chunks,
        load.tokens,
        cpu,
        load.errors,
        lags,
        workers,
        by_process,
        machine,
        gateway.config.derender.stream_interval,
    )


# -- scale-out: 1 vs N processor workers ---------------------------------------------------


def abba(counts: list[int], rounds: int) -> list[int]:
    """Worker counts in run order: as given, then reversed, and so on (1 2 2 1 1 2 ...)."""
    return [n for r in range(rounds) for n in (counts if r % 2 == 0 else counts[::-1])]


def scale_out_report(results: list[Result]) -> str:
    """Every run, then per worker count the median of its runs, and the ratios to the fewest workers."""
    first = results[0]
    lines = [
        f"processor scale-out: derender {first.derender}, qwen3 + hermes parsers, {first.concurrency} concurrent "
        f"streams, {first.requests} requests x {first.max_tokens} tokens per run (engine simulator, no delays); "
        f"run order {' '.join(str(r.workers) for r in results)} (ABBA)",
        "",
        "CPU per process group as a share of one core (the machine has "
        f"{CORES}: {CORES * 100}% is all of it); proc CPU = the supervisor's group, every worker; "
        "outside = every other process on the machine meanwhile (/proc/stat)",
    ]
    header = (
        f"{'run':>3} {'workers':>7} {'wall s':>7} {'req/s':>7} {'chunks/s':>9} {'proc CPU s':>10} "
        f"{'chunks/proc-CPU-s':>17} {'processor':>9} {'envoy':>6} {'render':>6} {'sim':>5} {'loadgen':>7} "
        f"{'outside':>7} {'ours/all cores':>14}  per process (CPU s)"
    )
    lines.append(header)
    for n, r in enumerate(results):
        share = {name: cpu / r.wall_s for name, cpu in r.cpu_s.items()}
        split = " ".join(f"{name}={cpu:.2f}" for name, cpu in r.processor_cpu_s.items())
        lines.append(
            f"{n + 1:>3} {r.workers:>7} {r.wall_s:>7.2f} {r.requests_per_s:>7.2f} {r.chunks_per_s:>9.0f} "
            f"{r.cpu_s['processor']:>10.2f} {r.chunks_per_processor_cpu_s:>17.0f} {share['processor']:>9.0%} "
            f"{share['envoy']:>6.0%} {share['render sidecar']:>6.0%} {share['simulator']:>5.0%} "
            f"{share['load generator']:>7.0%} {r.outside_cpu_s / r.wall_s:>7.0%} {r.machine_busy:>14.0%}  {split}"
        )
    by_count: dict[int, list[Result]] = {}
    for r in results:
        by_count.setdefault(r.workers, []).append(r)

    def median(runs: list[Result], value: Callable[[Result], float]) -> float:
        return statistics.median(value(r) for r in runs)

    lines += ["", "median per worker count:"]
    lines.append(
        f"{'workers':>7} {'runs':>4} {'req/s':>7} {'chunks/s':>9} {'proc CPU s':>10} {'chunks/proc-CPU-s':>17} "
        f"{'CPU s/request: processor':>24} {'others':>7} {'ours/all cores':>14} {'outside':>7}"
    )
    medians: dict[int, tuple[float, float]] = {}
    for count, runs in sorted(by_count.items()):
        rps = median(runs, lambda r: r.requests_per_s)
        cps = median(runs, lambda r: r.chunks_per_s)
        medians[count] = (rps, cps)
        proc_per_request = median(runs, lambda r: r.cpu_s["processor"] / r.requests)
        others_per_request = median(runs, lambda r: (sum(r.cpu_s.values()) - r.cpu_s["processor"]) / r.requests)
        lines.append(
            f"{count:>7} {len(runs):>4} {rps:>7.2f} {cps:>9.0f} {median(runs, lambda r: r.cpu_s['processor']):>10.2f} "
            f"{median(runs, lambda r: r.chunks_per_processor_cpu_s):>17.0f} {proc_per_request * 1e3:>21.1f} ms "
            f"{others_per_request * 1e3:>4.1f} ms {median(runs, lambda r: r.machine_busy):>14.0%} "
            f"{median(runs, lambda r: r.outside_cpu_s / r.wall_s):>7.0%}"
        )
    base = min(by_count)
    base_rps, base_cps = medians[base]
    base_runs = by_count[base]
    proc = median(base_runs, lambda r: r.cpu_s["processor"] / r.requests)
    everything = median(base_runs, lambda r: sum(r.cpu_s.values()) / r.requests)
    lines.append("")
    for count, (rps, cps) in sorted(medians.items()):
        if count == base:
            continue
        # If every request costs what it did with `base` workers, N workers run at most N / proc
        # requests/s, and the machine at most CORES / everything (load generator included).
        ceiling = min(count / proc, CORES / everything) / base_rps if proc > 0 and everything > 0 else float("nan")
        verdict = "met" if min(rps / base_rps, cps / base_cps) >= TARGET_SCALE_OUT else "NOT met"
        lines.append(
            f"{count} workers / {base}: requests/s x{rps / base_rps:.2f}, chunks/s x{cps / base_cps:.2f} "
            f"(target >= {TARGET_SCALE_OUT}x: {verdict}); ceiling on {CORES} cores from the {base}-worker "
            f"runs' CPU per request (processor {proc * 1e3:.1f} ms, all processes {everything * 1e3:.1f} ms): "
            f"x{ceiling:.2f}"
        )
    busy = [n + 1 for n, r in enumerate(results) if r.outside_cpu_s / r.wall_s > OUTSIDE_NOISE]
    if busy:
        lines.append(
            f"runs {', '.join(map(str, busy))} shared the machine with other work (outside > {OUTSIDE_NOISE:.0%} "
            "of one core): their numbers, and the ratios, are low by that much; run again on a quiet machine"
        )
    errors = [e for r in results for e in r.errors]
    lines += [f"error: {e}" for e in errors[:5]]
    if len(errors) > 5:
        lines.append(f"... {len(errors)} errors in all")
    return "\n".join(lines)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--derender", choices=["in_process", "sidecar"], default="in_process")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, help="streams in all (default: 4 * concurrency)")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        help="processor worker counts to compare, e.g. 1 2 (default: one run, the config's processor)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="with --workers: ABBA rounds over the counts")
    parser.add_argument(
        "--stream-interval",
        nargs="+",
        default=["auto"],
        type=_interval,
        help="derender.stream_interval per run (e.g. `1 auto`: the same load at each, compared)",
    )
    parser.add_argument("--cache-dir", default="~/.cache/tito", help="where the tiny model is (generated if missing)")
    parser.add_argument("--work-dir", help="config and logs (default: a new temporary directory)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.workers is not None and (min(args.workers) < 1 or args.rounds < 1):
        parser.error("--workers and --rounds: 1 or more")
    work_dir = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="tito-processor-bench-"))
    order = abba(sorted(set(args.workers)), args.rounds) if args.workers else []
    model_path = ensure_tiny_model(Path(args.cache_dir).expanduser())
    intervals: list[int | str] = args.stream_interval
    gateway = SimGatewayStack(work_dir, model_path, args.derender, order[0] if order else None, intervals[0])
    signal.signal(signal.SIGTERM, _raise_interrupt)
    print(f"starting render sidecar, simulator, processor, Envoy (logs in {work_dir / 'logs'}) ...", file=sys.stderr)
    requests = args.requests or 4 * args.concurrency
    results: list[Result] = []
    try:
        gateway.start()
        for n, interval in enumerate(intervals if not order else []):
            if n > 0:
                gateway.restart_gateway(gateway.config.processor.workers, interval)
            results.append(run(gateway, args.concurrency, requests, args.max_tokens, args.derender))
        for n, workers in enumerate(order):
            if n > 0:  # every run on a fresh processor and Envoy, the first one's included
                gateway.restart_gateway(workers)
            print(f"run {n + 1}/{len(order)}: {workers} processor worker(s) ...", file=sys.stderr)
            results.append(run(gateway, args.concurrency, requests, args.max_tokens, args.derender))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        gateway.stop()
    errors = any(r.errors for r in results)
    if args.json:
        print(json.dumps(json_safe([_summary(r) for r in results] if order else _summary(results[0])), indent=2))
    elif order:
        print(scale_out_report(results))
        print(machine_summary())
    else:
        for result in results:
            print(result.report())
        if len(results) > 1:
            print(interval_report(results))
        print(machine_summary())
    return 1 if errors else 0


def _interval(value: str) -> int | str:
    return value if value == "auto" else int(value)


def interval_report(results: list[Result]) -> str:
    """Processor CPU per engine token at each `stream_interval`, against the first run's."""
    first = 1e6 / results[0].engine_chunks_per_processor_cpu_s
    lines = [f"processor CPU per engine token (target {TARGET_US_PER_TOKEN} us with auto):"]
    for result in results:
        per_token = 1e6 / result.engine_chunks_per_processor_cpu_s
        lines.append(
            f"  stream_interval {result.stream_interval!s:>4}: {per_token:6.1f} us per token, "
            f"{result.chunks_per_processor_cpu_s:7.0f} client chunks per processor-CPU-second, "
            f"x{per_token / first:.2f} of stream_interval {results[0].stream_interval}"
        )
    return "\n".join(lines)


def _summary(result: Result) -> dict[str, Any]:
    return {
        **asdict(result),
        "requests_per_s": result.requests_per_s,
        "chunks_per_s": result.chunks_per_s,
        "chunks_per_processor_cpu_s": result.chunks_per_processor_cpu_s,
        "engine_chunks_per_processor_cpu_s": result.engine_chunks_per_processor_cpu_s,
        "target": TARGET_CHUNKS_PER_CPU_S,
        "machine": machine_summary(),
    }


if __name__ == "__main__":
    sys.exit(main())
