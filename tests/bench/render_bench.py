"""Render throughput and latency: one render endpoint against two, and in-process render.

A multi-turn chat workload, as agents and chat front ends send it: every conversation has the
same system prompt and tools, and each request is a conversation up to one of its turns (the
earlier turns repeated, as clients resend them). Render is vLLM's own (`vllm launch render`
processes, or its renderer loaded in this process), called through the gateway's own render
pool client.

Printed:
- sidecar, 1 and 2 endpoints, at --concurrency: renders/s and p50/p99 latency, medians over
  --rounds interleaved runs (ABBA), and the ratio of 2 endpoints over 1;
- in process: CPU per request uncached, with the prefix cache, and with the prefix cache and
  parsers reused (medians of interleaved runs); the last over the first against the target of
  0.5; the cache's hit rate and how often parsers were reused.

Run: `python -m tests.bench.render_bench [--requests 256] [--concurrency 8] [--rounds 2]`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from ext_proc.config import LocalStackConfig, ModelConfig, RenderConfig, RenderEndpoint
from ext_proc.frontend.render import RenderClient, Renderer
from ext_proc.frontend.render_pool import RenderPool, pool_member
from ext_proc.protocol import OpenAIRequest, Pipeline
from ext_proc.tools.local_stack import OFFLINE, ManagedProcess
from ext_proc.tools.tiny_model import ensure_tiny_model
from render_sidecar.launch import render_command
from tests.bench.gateway_bench import PARSERS, machine_summary
from tests.conftest import free_ports

SYSTEM = "You are a careful assistant for a travel agency. " * 12
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')} for a city and a date range",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "from": {"type": "string"}, "to": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    for name in ("search_hotels", "search_flights", "get_weather")
]
TARGET_CACHED = 0.5  # in-process render CPU per multi-turn request, cached over uncached
CITIES = ["Lisbon", "Kyoto", "Nairobi", "Quito", "Oslo", "Hanoi", "Tunis", "Perth"]


def workload(n: int, model: str, first: int = 0) -> list[bytes]:
    """`n` chat bodies: conversations (numbered from `first`, so another run's are new to the
    cache) of up to 6 turns, each request one of them up to a turn. Per request, what the
    cache has not seen is the assistant's last answer and the new user turn."""
    bodies = []
    conversation = first
    while len(bodies) < n:
        city = CITIES[conversation % len(CITIES)]
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        for turn in range(6):
            ask = f"Trip {conversation}, turn {turn}: plan day {turn + 1} in {city}, please."
            messages.append({"role": "user", "content": ask})
            body = {"model": model, "messages": list(messages), "tools": TOOLS, "max_tokens": 16}
            bodies.append(orjson.dumps(body))
            answer = f"Trip {conversation}, day {turn + 1} in {city}: a walk, a museum, dinner."
            messages.append({"role": "assistant", "content": answer})
        conversation += 1
    return bodies[:n]


@dataclass
class Run:
    per_s: float
    p50_ms: float
    p99_ms: float


async def drive(renderer: Renderer, bodies: list[bytes], concurrency: int) -> Run:
    queue = list(reversed(bodies))
    latencies: list[float] = []

    async def worker() -> None:
        while queue:
            raw = queue.pop()
            started = time.perf_counter()
            await renderer.render(OpenAIRequest(Pipeline.CHAT, orjson.loads(raw)), raw, "bench")
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    ordered = sorted(latencies)
    return Run(len(bodies) / elapsed, 1000 * ordered[len(ordered) // 2], 1000 * ordered[int(0.99 * (len(ordered) - 1))])


def pool_of(endpoints: list[RenderEndpoint], model: str) -> RenderPool:
    members = [pool_member(e.address, e.url, RenderClient(e.url, 30_000), 5.0) for e in endpoints]
    return RenderPool(members, model, 1e9)


def median_run(runs: list[Run]) -> Run:
    return Run(*(statistics.median(getattr(r, f) for r in runs) for f in ("per_s", "p50_ms", "p99_ms")))


def line(label: str, run: Run) -> str:
    return f"{label:<22} {run.per_s:7.1f} renders/s, p50 {run.p50_ms:6.1f} ms, p99 {run.p99_ms:6.1f} ms"


async def sidecar(model: ModelConfig, options: argparse.Namespace, work: Path) -> list[str]:
    port = free_ports(2)
    endpoints = [RenderEndpoint(port=port), RenderEndpoint(port=port + 1)]
    processes = [
        ManagedProcess(
            f"render{i}", render_command(RenderConfig(), model, str(model.path), e), work / f"render{i}.log", OFFLINE
        )
        for i, e in enumerate(endpoints)
    ]
    for process in processes:
        process.start()
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
            await _ready(http, [e.url + "/health" for e in endpoints])
            bodies = workload(options.requests, model.served_name)
            pools = {n: pool_of(endpoints[:n], model.served_name) for n in (1, 2)}
            await drive(pools[2], bodies[:32], options.concurrency)  # warm both
            runs: dict[int, list[Run]] = {1: [], 2: []}
            for n in [1, 2, 2, 1] * options.rounds:  # ABBA: drift weighs on both alike
                runs[n].append(await drive(pools[n], bodies, options.concurrency))
    finally:
        for process in processes:
            process.stop()
    one, two = median_run(runs[1]), median_run(runs[2])
    return [
        line("sidecar, 1 endpoint", one),
        line("sidecar, 2 endpoints", two),
        f"2 endpoints over 1: x{two.per_s / one.per_s:.2f} renders/s, p99 x{two.p99_ms / one.p99_ms:.2f}",
    ]


async def _ready(http: httpx.AsyncClient, urls: list[str], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    for url in urls:
        while True:
            try:
                if (await http.get(url)).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not ready")
            await asyncio.sleep(0.5)


async def cpu_per_request(render: Callable[[bytes], Awaitable[Any]], bodies: list[bytes]) -> float:
    """CPU milliseconds per render, one request at a time (this process does all the work)."""
    started = time.process_time()
    for raw in bodies:
        await render(raw)
    return 1000 * (time.process_time() - started) / len(bodies)


async def in_process(model: ModelConfig, options: argparse.Namespace) -> list[str]:
    """CPU per request of in-process render: plain, with the prefix cache, and with the prefix
    cache and parsers reused (what `tito` runs by default), interleaved."""
    from ext_proc.frontend.render_in_process import InProcessRender

    renderers = {
        "uncached": await InProcessRender.load(model),
        "prefix cache": await InProcessRender.load(model, prefix_cache=True),
        "cached": await InProcessRender.load(model, prefix_cache=True, reuse_parsers=True),
    }

    def render_with(renderer: InProcessRender) -> Callable[[bytes], Awaitable[Any]]:
        async def render(raw: bytes) -> Any:
            return await renderer.render(OpenAIRequest(Pipeline.CHAT, orjson.loads(raw)), raw, "bench")

        return render

    for renderer in renderers.values():  # warm, on conversations of their own
        await cpu_per_request(render_with(renderer), workload(32, model.served_name, first=10**6))
    runs: dict[str, list[float]] = {name: [] for name in renderers}
    order = list(renderers) + list(reversed(renderers))
    for n, name in enumerate(order * options.rounds):
        bodies = workload(options.requests, model.served_name, first=1000 * n)  # new to the cache
        runs[name].append(await cpu_per_request(render_with(renderers[name]), bodies))
    cpu = {name: statistics.median(values) for name, values in runs.items()}
    cache = renderers["cached"].prefix_cache
    parsers = renderers["cached"].parsers
    assert cache is not None and parsers is not None
    stats = cache.snapshot()
    ratio = cpu["cached"] / cpu["uncached"]
    verdict = "meets" if ratio <= TARGET_CACHED else "misses"
    return [
        f"{'in process, uncached':<40} {cpu['uncached']:7.2f} ms CPU per request",
        f"{'in process, prefix cache':<40} {cpu['prefix cache']:7.2f} ms CPU per request "
        f"(x{cpu['prefix cache'] / cpu['uncached']:.2f})",
        f"{'in process, prefix cache, parsers reused':<40} {cpu['cached']:7.2f} ms CPU per request",
        f"cached: x{ratio:.2f} CPU per request ({verdict} the target x{TARGET_CACHED}); prefix cache hit rate "
        f"{stats['hit_rate']:.0%} of pieces, {stats['char_hit_rate']:.0%} of characters; "
        f"parsers built {parsers.built}, reused {parsers.reused}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.render_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="render-bench-") as tmp:
        work = Path(tmp)
        path = ensure_tiny_model(Path(LocalStackConfig().cache_dir).expanduser())
        model = ModelConfig.model_validate({"path": str(path), **PARSERS})
        print(machine_summary(), flush=True)
        print(
            f"workload: {options.requests} multi-turn chat requests (shared system prompt and 3 tools), "
            f"concurrency {options.concurrency}, {options.rounds} rounds",
            flush=True,
        )
        lines = asyncio.run(sidecar(model, options, work))
        lines += asyncio.run(in_process(model, options))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
