"""Gateway vs native vLLM on one machine: a real local stack (`tito up`), then `tito bench`.

Starts render sidecar + CPU vLLM engine + processor + Envoy on free ports (logs under
--work-dir), and for each --max-tokens value runs the same streaming workload against the Envoy
listener and the engine's own OpenAI endpoint, interleaved (ext_proc/tools/bench.py). The engine is
both the gateway's upstream and the native reference, so the difference is what the gateway
adds: render, scheduling, the ext_proc round trips and derender.

`--start-cost N` then sends N one-token streaming requests per side, one at a time, and prints
the CPU each process spent per request: the start-up work that concurrent requests queue behind.
The processor's event-loop thread is shown apart from its helper threads (vLLM's tokenization
pool, the thread that builds derender sessions, gRPC's poller and EventEngine threads).

Run: `python -m tests.bench.gateway_bench [--parsers/--no-parsers] [--derender in_process|sidecar]
[--max-tokens 256 1024] [--concurrency 8] [--tools] [--start-cost 200]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from ext_proc.config import TitoConfig
from ext_proc.tools.bench import run_bench
from ext_proc.tools.bench_report import BenchReport, format_report
from ext_proc.tools.bench_workload import PROMPTS, BenchOptions
from ext_proc.tools.local_stack import LocalStack
from ext_proc.tools.tiny_model import ensure_tiny_model
from tests.bench.cpu_accounting import group_cpu_by_pid, main_thread_cpu_seconds, own_cpu_seconds

PARSERS: dict[str, Any] = {"reasoning_parser": "qwen3", "tool_call_parser": "hermes", "enable_auto_tool_choice": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def machine_summary() -> str:
    cores = len(os.sched_getaffinity(0))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"machine: {cores} cores (nproc), {cpu_model()}, load average {load}"


def stack_config(
    work_dir: Path, model_path: Path, parsers: bool, derender: str, max_model_len: int = 2048, render: str = "sidecar"
) -> TitoConfig:
    """`tito up`'s config on free ports (so it runs next to other stacks)."""
    model: dict[str, Any] = {"path": str(model_path), "max_model_len": max_model_len}
    if parsers:
        model |= PARSERS
    return TitoConfig.model_validate(
        {
            "listener": {"port": free_port(), "admin_port": free_port()},
            "processor": {"port": free_port(), "admin_port": free_port()},
            "render_config": {"endpoint": {"port": free_port()}, "mode": render},
            "derender": {"mode": derender},
            "model": model,
            "pools": [{"instances": [{"port": free_port()}]}],
            "local": {"cache_dir": str(work_dir)},
        }
    )


PROCESSOR_LOOP = "  of which its event loop"  # a part of the processor's row, not a process


def _cpu_by_process(stack: LocalStack) -> dict[str, float]:
    """CPU seconds so far of the stack's processes (each its own process group); an engine's
    API server (its group's leader) apart from its EngineCore and worker, which `tito up`
    binds to the worker's cores."""
    engines = {name for name, _, _ in stack.engines()}
    cpu: dict[str, float] = {}
    for name, process in stack.processes.items():
        if process.popen is None:
            continue
        pgid = process.popen.pid
        by_pid = group_cpu_by_pid(pgid)
        if name in engines:
            cpu[f"{name} API server"] = by_pid.pop(pgid, 0.0)
            cpu[f"{name} core + worker"] = sum(by_pid.values())
        else:
            cpu[name] = sum(by_pid.values())
        if name == "processor":  # the event loop apart: gRPC, the exchange, render's async part
            cpu[PROCESSOR_LOOP] = sum(main_thread_cpu_seconds(pid) for pid in by_pid)
    cpu["load generator"] = own_cpu_seconds()
    return cpu


def start_cost(stack: LocalStack, native: str, model: str, requests: int, block: int = 10) -> str:
    """CPU per request, by process, of requests that are all start-up: streaming chat with
    `max_tokens` 1, one at a time, the two sides in alternating blocks. Measures what each
    request costs before its tokens (render, scheduling, ext_proc messages, the engine's
    request handling), which is what 8 requests arriving together queue behind."""
    spent: dict[str, dict[str, float]] = {"gateway": {}, "native": {}}
    urls = {"gateway": stack.base_url, "native": native}
    body = one_token_chat(model)
    with httpx.Client(timeout=60, trust_env=False) as client:
        for side in urls:  # warm-up: connections, caches
            _chat(client, urls[side], body)
        blocks = -(-requests // block)  # per side
        for n in range(2 * blocks):
            side = list(urls)[n % 2]
            before = _cpu_by_process(stack)
            for _ in range(block):
                _chat(client, urls[side], body)
            after = _cpu_by_process(stack)
            for name, seconds in after.items():
                spent[side][name] = spent[side].get(name, 0.0) + seconds - before.get(name, 0.0)
    done = {side: block * blocks for side in spent}
    lines = [
        f"start-up CPU per request ({done['gateway']} streaming chat requests per side, max_tokens 1, one at a time), ms:"
    ]
    lines.append(f"  {'process':24s} {'gateway':>8s} {'native':>8s}")
    for name in spent["gateway"]:
        gateway_ms, native_ms = (1000 * spent[side][name] / done[side] for side in ("gateway", "native"))
        lines.append(f"  {name:24s} {gateway_ms:8.2f} {native_ms:8.2f}")
    free = {
        side: sum(
            v
            for k, v in spent[side].items()
            if "core + worker" not in k and k not in ("load generator", PROCESSOR_LOOP)
        )
        / done[side]
        for side in spent
    }
    lines.append(
        f"  outside the engine's bound cores and the load generator: gateway {1000 * free['gateway']:.2f} ms, "
        f"native {1000 * free['native']:.2f} ms, x{free['gateway'] / free['native']:.2f}"
        if free["native"] > 0
        else "  too few requests to measure (/proc counts CPU in clock ticks)"
    )
    return "\n".join(lines)


def one_token_chat(model: str) -> dict[str, Any]:
    """The start-up workload: a streaming chat answered with one token."""
    return {"model": model, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 1, "stream": True}


def _chat(client: httpx.Client, url: str, body: dict[str, Any]) -> None:
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for _ in response.iter_bytes():
            pass


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--parsers", action=argparse.BooleanOptionalAction, default=True, help="qwen3 + hermes")
    parser.add_argument("--derender", choices=["in_process", "sidecar"], default="in_process")
    parser.add_argument("--render", choices=["sidecar", "in_process"], default="sidecar")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, help="per side and max_tokens value (default: 2 * concurrency)")
    parser.add_argument("--api", choices=["chat", "completions"], default="chat")
    parser.add_argument("--tools", action="store_true", help="tools + reasoning workload (needs --parsers)")
    parser.add_argument("--warmup", type=int, default=1, metavar="ROUNDS", help="unmeasured rounds per side")
    parser.add_argument("--cache-dir", default="~/.cache/tito", help="where the tiny model is (generated if missing)")
    parser.add_argument("--work-dir", help="config and logs of the stack (default: a new temporary directory)")
    parser.add_argument("--json", action="store_true", help="print the reports as JSON")
    parser.add_argument(
        "--start-cost",
        type=int,
        default=0,
        metavar="N",
        help="then N one-token requests per side, one at a time: CPU per request by process",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tools and (args.api != "chat" or not args.parsers):
        parser.error("--tools needs --api chat and --parsers")
    work_dir = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="tito-gateway-bench-"))
    model_path = ensure_tiny_model(Path(args.cache_dir).expanduser())
    longest = max(args.max_tokens)
    config = stack_config(work_dir, model_path, args.parsers, args.derender, max(2048, longest + 512), args.render)
    stack = LocalStack(config, work_dir)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # stop the stack on a plain kill too
    reports: list[BenchReport] = []
    print(f"starting the stack (logs in {work_dir / 'logs'}) ...", file=sys.stderr, flush=True)
    try:
        stack.start()
        native = config.pools[0].instances[0].url
        for max_tokens in args.max_tokens:
            options = BenchOptions(
                gateway=stack.base_url,
                native=native,
                model=config.model.served_name,
                concurrency=args.concurrency,
                max_tokens=max_tokens,
                api=args.api,
                requests=args.requests or 2 * args.concurrency,
                tools=args.tools,
                warmup_rounds=args.warmup,
            )
            report = asyncio.run(run_bench(options))
            reports.append(report)
            if not args.json:
                print(format_report(report) + "\n", flush=True)
        if args.start_cost:
            print(start_cost(stack, native, config.model.served_name, args.start_cost) + "\n", flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        stack.stop()
    parsers = "qwen3 + hermes parsers" if args.parsers else "no parsers"
    if args.json:
        summary = {
            "render": args.render,
            "derender": args.derender,
            "parsers": args.parsers,
            "machine": machine_summary(),
        }
        print(json.dumps({**summary, "reports": [r.to_json() for r in reports]}, indent=2))
    else:
        print(
            f"summary: render {args.render}, derender {args.derender}, {parsers}, {args.concurrency} concurrent streams"
        )
        for r in reports:
            g, n = r.sides["gateway"], r.sides["native"]
            print(
                f"  max_tokens {r.options.max_tokens:>5}: E2E p50 {g.e2e_p50_ms:.0f} vs {n.e2e_p50_ms:.0f} ms "
                f"(x{r.e2e_p50_ratio:.2f}), TTFT p50 {r.ttft_p50_diff_ms:+.1f} ms, "
                f"gap mean x{r.gap_mean_ratio:.2f}, errors {r.errors}"
            )
        print(machine_summary())
    return 1 if any(r.errors for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
