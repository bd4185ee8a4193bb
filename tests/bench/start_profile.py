"""Where one request's start-up CPU goes: the processor's event loop stage by stage, its
other threads, the render sidecar, Envoy and the engine's API server, per one-token request.

Starts a `tito up` stack on free ports with `processor.profile_stages` on (every event-loop
task's steps charged to its request's stage: `ext_proc/observability/stage_cpu.py`), sends
`--requests` one-token streaming chats at each `--concurrency`, and prints CPU ms per request:
the loop's stages (what the processor's tasks ran), the loop outside them (gRPC's and the
HTTP client's callbacks, the loop itself), the processor's other threads by name (from
/proc), and the other processes of the stack. `--flame DIR` also records a py-spy flame graph
of the processor during the first concurrency's requests (an SVG per render mode).

Run: `python -m tests.bench.start_profile [--render sidecar in_process] [--concurrency 1 8]
[--requests 300] [--flame DIR]`.
"""

from __future__ import annotations

import argparse
import collections
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from ext_proc.observability.stage_cpu import STAGES
from ext_proc.tools.local_stack import LocalStack
from ext_proc.tools.tiny_model import ensure_tiny_model
from tests.bench.cpu_accounting import CLOCK_TICKS, group_cpu_by_pid
from tests.bench.gateway_bench import _chat, _raise_interrupt, machine_summary, one_token_chat, stack_config

LOOP_OUTSIDE = "loop outside request tasks"
COUNTS = ("messages", "replies")  # ext_proc messages from Envoy and back, per request


def thread_cpu_by_name(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of `pid`, summed by thread name (the loop is the main thread)."""
    by_name: dict[str, float] = collections.defaultdict(float)
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # ended meanwhile
        name = "event loop (main thread)" if int(task.name) == pid else stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        by_name[name] += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return dict(by_name)


class Snapshot:
    """The CPU counters of the stack at one moment."""

    def __init__(self, stack: LocalStack, admin: str) -> None:
        self.stages: dict[str, Any] = httpx.get(admin + "/debug/stages", timeout=10, trust_env=False).json()
        processor = stack.processes["processor"].popen
        assert processor is not None
        self.threads = thread_cpu_by_name(processor.pid)
        self.processes: dict[str, float] = {}
        for name, process in stack.processes.items():
            if process.popen is not None and name != "processor":
                by_pid = group_cpu_by_pid(process.popen.pid)
                # An engine's API server is its group's leader; its EngineCore and worker spin on
                # their bound cores whatever the gateway does, so they are left out.
                self.processes[name] = (
                    by_pid.get(process.popen.pid, 0.0) if name.startswith("engine") else sum(by_pid.values())
                )


def measure(stack: LocalStack, admin: str, body: dict[str, Any], requests: int, concurrency: int) -> dict[str, float]:
    """CPU ms per request by row, over `requests` one-token chats `concurrency` at a time."""
    per_client = -(-requests // concurrency)
    done = per_client * concurrency

    def client(_: int) -> None:
        with httpx.Client(timeout=60, trust_env=False) as http:
            for _ in range(per_client):
                _chat(http, stack.base_url, body)

    before = Snapshot(stack, admin)
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(client, range(concurrency)))
    after = Snapshot(stack, admin)
    if after.stages["requests"] - before.stages["requests"] != done:
        print(f"warning: {after.stages['requests'] - before.stages['requests']} requests finished, not {done}")
    rows: dict[str, float] = {}
    for stage in after.stages["stages_s"]:
        rows[stage] = after.stages["stages_s"][stage] - before.stages["stages_s"].get(stage, 0.0)
    in_tasks = sum(rows.values())
    loop = after.stages["loop_thread_s"] - before.stages["loop_thread_s"]
    rows[LOOP_OUTSIDE] = loop - in_tasks
    for name, seconds in sorted(after.threads.items()):
        if name != "event loop (main thread)":
            rows[f"thread {name}"] = seconds - before.threads.get(name, 0.0)
    rows["processor, all threads"] = sum(after.threads.values()) - sum(before.threads.values())
    for name, seconds in after.processes.items():
        rows[f"process {name}" + (" (API server)" if name.startswith("engine") else "")] = (
            seconds - before.processes.get(name, 0.0)
        )
    per_request = {row: 1000 * seconds / done for row, seconds in rows.items()}
    for count in COUNTS:  # (not CPU: how many, per request)
        per_request[count] = (after.stages[count] - before.stages[count]) / done
    return per_request


def profile(render: str, args: argparse.Namespace) -> str:
    work_dir = Path(tempfile.mkdtemp(prefix=f"tito-start-profile-{render}-"))
    model_path = ensure_tiny_model(Path(args.cache_dir).expanduser())
    config = stack_config(work_dir, model_path, args.parsers, "in_process", render=render)
    config.processor.profile_stages = True
    stack = LocalStack(config, work_dir)
    admin = f"http://127.0.0.1:{config.processor.admin_port}"
    body = one_token_chat(config.model.served_name)
    print(f"starting the {render} stack (logs in {work_dir / 'logs'}) ...", file=sys.stderr, flush=True)
    columns: dict[int, dict[str, float]] = {}
    try:
        stack.start()
        with httpx.Client(timeout=60, trust_env=False) as http:  # warm-up: connections, caches
            for _ in range(20):
                _chat(http, stack.base_url, body)
        for n, concurrency in enumerate(args.concurrency):
            flame = _flame(stack, Path(args.flame) / f"processor-{render}.svg") if args.flame and n == 0 else None
            try:
                columns[concurrency] = measure(stack, admin, body, args.requests, concurrency)
            finally:
                if flame is not None:
                    flame.send_signal(signal.SIGINT)  # py-spy writes the SVG on SIGINT
                    flame.wait(60)
    finally:
        stack.stop()
    return table(render, args, columns)


def _flame(stack: LocalStack, out: Path) -> subprocess.Popen[bytes]:
    processor = stack.processes["processor"].popen
    assert processor is not None
    out.parent.mkdir(parents=True, exist_ok=True)
    command = ["py-spy", "record", "--pid", str(processor.pid), "--rate", "500", "--output", str(out)]
    print(f"flame graph of the processor: {out}", file=sys.stderr, flush=True)
    return subprocess.Popen([str(Path(sys.executable).parent / command[0]), *command[1:]], stdout=subprocess.DEVNULL)


def table(render: str, args: argparse.Namespace, columns: dict[int, dict[str, float]]) -> str:
    rows = list(dict.fromkeys(row for column in columns.values() for row in column))
    head = "".join(f"{f'c={c}':>9s}" for c in columns)
    lines = [
        f"render {render}: CPU ms per one-token streaming chat ({args.requests} requests per column)",
        f"  {'':34s}{head}",
    ]
    for row in rows:
        label = (
            f"  loop: {row}"
            if row in STAGES or row == LOOP_OUTSIDE
            else f"  ext_proc {row} (count)"
            if row in COUNTS
            else f"  {row}"
        )
        lines.append(f"{label:36s}" + "".join(f"{columns[c].get(row, 0.0):9.3f}" for c in columns))
        if row == LOOP_OUTSIDE:
            loop = {c: sum(columns[c].get(r, 0.0) for r in (*STAGES, LOOP_OUTSIDE)) for c in columns}
            lines.append(f"{'  loop, all':36s}" + "".join(f"{loop[c]:9.3f}" for c in columns))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--render", choices=["sidecar", "in_process"], nargs="+", default=["sidecar", "in_process"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=300, help="per concurrency")
    parser.add_argument("--parsers", action=argparse.BooleanOptionalAction, default=True, help="qwen3 + hermes")
    parser.add_argument("--flame", metavar="DIR", help="py-spy flame graphs of the processor, one per render mode")
    parser.add_argument("--cache-dir", default="~/.cache/tito")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        for render in args.render:
            print(profile(render, args) + "\n", flush=True)
    except KeyboardInterrupt:
        return 130
    print(machine_summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
