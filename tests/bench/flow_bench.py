"""Flow control on `tito up` with a real CPU engine: fair share, priority bands and tenants'
tokens per minute, measured as clients see them (figures printed, not a timed test).

    python -m tests.bench.flow_bench [fairness|priority|quota|all] [--rounds 3]   # default all

One `tito up` for every scenario: the default local pool (one CPU vLLM engine, the tiny
model), two processor workers, a global token budget of 360 tokens (4 requests of a
~22-token prompt + 64 output tokens: each worker's equal share, 180, holds two), a queue of
60 s and 16 requests per worker (the priority phase fills it), flows active for 5 s, API keys of six tenants (`quiet`,
`noisy`, `hi` priority 10, `std`, `batch` priority -1, `metered` 3000 tokens per minute) and
a real redis-server for the quotas (fail mode `local`). Every request is a streamed chat with
its tenant's key (`ignore_eos`: it always takes max_tokens), sent by closed-loop workers (a
worker's next request as its last one ends; after a refusal it pauses 0.5 s first); each
tenant's workers run in a client process of their own, so one tenant's stream parsing never
delays the clock of another's requests. A request that raises or has not ended after 120 s is LOST.

Printed, each target as `PASS`/`FAIL target: value`:
- fairness, in `--rounds` interleaved rounds (alone, then beside the flood: the machine's
  drift weighs on both): `quiet` alone for 15 s (TTFT p50, p99); then `noisy`'s 10 workers
  for 20 s, which `quiet` joins 3 s in: its TTFT ratios to alone (target <= 1.5) over its
  requests from 1 s after it joined (its first ones, printed apart, met the flood holding the
  whole budget and waited for one of its requests to end); both backlogged once (12 and 6
  workers, 60 s: tokens served per tenant in the middle 40 s, each share within 0.5 +- 10 %,
  Jain's index >= 0.95).
- priority, in interleaved rounds too: `hi` alone for 15 s (TTFT p99); then `std` x 8 and
  `batch` x 40 for 25 s, which `hi` joins 5 s in (its TTFT p99 ratio, target <= 1.3, from
  1 s after it joined; statuses per tenant; only `batch` refused or evicted, with
  `admission.evict_sheddable` on; every request answered: served, 429 with Retry-After, or
  a stream ended by its eviction notice).
- quota: `metered` x 4 (max_tokens 16) for 130 s from a minute's start, Redis stopped at 70 s
  and started at 100 s: what Redis charged per complete minute window (target 0.95-1.0 of
  the quota), what clients were granted per window and per 10 s, and the processors'
  `redis_up` through the outage.
- the end: what every worker's `/debug/state` holds once all requests ended (no leaks).

Each phase also prints where the time went: the processors' admission queue (per band: how
many waited, for how long, from `/metrics`), the engine's own TTFT (vLLM's `/metrics`),
every worker's `/debug/state` sampled every 5 s (queued per band, oldest wait, admitted
tokens), and how busy each core was (`/proc/stat`). The samples are kept in `states.jsonl`
of the bench's folder, every request's figures in `results.jsonl`. `tito up`'s smoke request carries the `std` key (`TITO_API_KEY`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import multiprocessing
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis
from redis.exceptions import RedisError

from ext_proc.config import TitoConfig
from ext_proc.tenancy.keys import hash_key
from ext_proc.tools.local_stack import run_dir
from tests.bench.sse import DONE, events, story_chat
from tests.bench.up import running_up
from tests.redis_server import RedisServer

PROMPTS = 16  # distinct prompts, cycled
M = 64  # output tokens of every request but the quota's
QUOTA_M = 16
BUDGET = 360  # global_token_budget: 4 x (prompt ~22 + M), checked against the gateway's usage
TPM = 3000  # `metered`'s tokens per minute
PROCESSORS = 2  # processor workers
QUEUE_TIMEOUT_S = 60
QUEUE_MAX_REQUESTS = 16  # per worker: the priority phase's 49 clients fill it (sheddable work is shed)
FLOW_ACTIVE_S = 5
ROUNDS = 3  # interleaved rounds: quiet phase, loaded phase
ALONE_S, FLOOD_S = 15, 20  # fairness: `quiet` alone; beside `noisy`'s flood
JOIN_S = 3  # `quiet` joins the flood this long after `noisy` started it
JOINED_S = 1  # then its TTFT is measured from this long after it joined (its first requests
# found the budget held by the flood, whose flow was the only active one: they wait for one of
# its requests to end, as on any non-preemptive fair queue; printed apart)
UNLOADED_S, SATURATED_S = 15, 25  # priority: `hi` alone; beside `std` and `batch`
SATURATE_S = 5  # `hi` joins once `batch` has filled the queue
LOST_AFTER_S = 120
SAMPLE_S = 5  # /debug/state sampling period
REFUSED_PAUSE_S = 0.5  # a worker's pause after a refusal (429s come back at once)
WINDOW_S = 60  # the quota's minute windows
TENANTS: dict[str, dict[str, Any]] = {
    "quiet": {"priority": 0, "weight": 1},
    "noisy": {"priority": 0, "weight": 1},
    "hi": {"priority": 10},
    "std": {"priority": 0},
    "batch": {"priority": -1},
    "metered": {"tokens_per_minute": TPM},
}
SMOKE_TENANT = "std"  # whose key `tito up`'s smoke request presents


def api_key(tenant: str) -> str:
    return f"flow-bench-{tenant}"


def body(i: int, max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return story_chat(i, max_tokens, PROMPTS, stream)


# -- one request ----------------------------------------------------------------------------


@dataclass
class Result:
    """One request as its client saw it; times in seconds from its phase's start."""

    tenant: str
    max_tokens: int
    start: float
    wall: float  # time.time() at the start (the quota's minute windows)
    end: float = 0.0
    ttft: float | None = None  # to the first chunk with content, from the start
    status: int | None = None
    retry_after: str | None = None
    code: str | None = None  # a refusal's error code
    tokens: int = 0  # usage: prompt + completion
    proper: bool = False  # one [DONE], no error event, a usage
    evicted: bool = False  # a stream ended by flow control's eviction notice (an error event, one [DONE])
    lost: str | None = None  # raised or hung: why

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.lost is None


async def one_request(http: httpx.AsyncClient, url: str, tenant: str, i: int, max_tokens: int, t0: float) -> Result:
    result = Result(tenant, max_tokens, time.monotonic() - t0, time.time())
    try:
        async with asyncio.timeout(LOST_AFTER_S):
            await _exchange(http, url, i, result, time.monotonic())
    except TimeoutError:
        result.lost = f"not ended after {LOST_AFTER_S} s"
    except (httpx.HTTPError, ValueError) as error:  # (ValueError: an event that is not JSON)
        result.lost = type(error).__name__
    result.end = time.monotonic() - t0
    return result


async def _exchange(http: httpx.AsyncClient, url: str, i: int, result: Result, began: float) -> None:
    headers = {"authorization": f"Bearer {api_key(result.tenant)}"}
    request = body(i, result.max_tokens)
    async with http.stream("POST", url + "/v1/chat/completions", json=request, headers=headers) as response:
        result.status = response.status_code
        result.retry_after = response.headers.get("retry-after")
        if response.status_code != 200:
            result.code = _error_code(await response.aread())
            return
        done, error, usage = 0, False, None
        async for event in events(response):
            if event == DONE:
                done += 1
                continue
            assert isinstance(event, dict)
            error = error or "error" in event
            result.evicted = result.evicted or (event.get("error") or {}).get("code") == "evicted"
            if result.ttft is None and any((c.get("delta") or {}).get("content") for c in event.get("choices", [])):
                result.ttft = time.monotonic() - began
            usage = event.get("usage") or usage
    if usage:
        result.tokens = usage["prompt_tokens"] + usage["completion_tokens"]
    result.proper = done == 1 and not error and usage is not None
    result.evicted = result.evicted and done == 1


def _error_code(raw: bytes) -> str:
    try:
        error = json.loads(raw).get("error") or {}
        return str(error.get("code") or error.get("type") or "?")
    except (ValueError, AttributeError):
        return "?"


async def closed_loop(
    http: httpx.AsyncClient,
    url: str,
    tenant: str,
    workers: int,
    max_tokens: int,
    t0: float,
    until: float | None,
    requests: int | None,
    start_s: float = 0.0,
) -> list[Result]:
    """`workers` clients of one tenant, each sending its next request as its last one ends,
    from `start_s` after `t0` until `until` (monotonic) or `requests` in all."""
    results: list[Result] = []
    numbers = itertools.count()
    await asyncio.sleep(max(0.0, t0 + start_s - time.monotonic()))

    async def worker() -> None:
        while True:
            n = next(numbers)
            if (requests is not None and n >= requests) or (until is not None and time.monotonic() >= until):
                return
            result = await one_request(http, url, tenant, n, max_tokens, t0)
            results.append(result)
            if not result.ok:
                await asyncio.sleep(REFUSED_PAUSE_S)

    await asyncio.gather(*(worker() for _ in range(workers)))
    return results


@dataclass(frozen=True)
class Load:
    """One tenant's closed-loop clients in a phase, joining `start_s` after its start."""

    tenant: str
    workers: int
    start_s: float = 0.0


def client_process_loop(
    url: str, load: Load, max_tokens: int, t0: float, until: float | None, requests: int | None
) -> list[dict[str, Any]]:
    """A tenant's closed loop in its own client process (the monotonic clock is the
    machine's, so `t0` holds across processes)."""

    async def loop() -> list[Result]:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=LOST_AFTER_S, limits=limits, trust_env=False) as http:
            return await closed_loop(
                http, url, load.tenant, load.workers, max_tokens, t0, until, requests, load.start_s
            )

    return [asdict(r) for r in asyncio.run(loop())]


class Clients:
    """One client process per tenant, kept for the whole bench: tenants are separate clients,
    so one tenant's stream parsing never delays the clock of another's requests."""

    def __init__(self) -> None:
        self._processes: dict[str, ProcessPoolExecutor] = {}

    def _process(self, tenant: str) -> ProcessPoolExecutor:
        if tenant not in self._processes:
            self._processes[tenant] = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        return self._processes[tenant]

    async def run(
        self, url: str, load: Load, max_tokens: int, t0: float, until: float | None, requests: int | None
    ) -> list[Result]:
        future = self._process(load.tenant).submit(client_process_loop, url, load, max_tokens, t0, until, requests)
        return [Result(**r) for r in await asyncio.wrap_future(future)]

    async def warm(self, tenants: list[str]) -> None:
        """Each tenant's process started (spawned and imported) before any phase's clock."""
        for tenant in tenants:
            await asyncio.wrap_future(self._process(tenant).submit(time.monotonic))

    def close(self) -> None:
        for process in self._processes.values():
            process.shutdown(cancel_futures=True)


# -- figures --------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else math.nan


def ttfts(results: list[Result], tenant: str) -> list[float]:
    return [r.ttft for r in results if r.tenant == tenant and r.ok and r.ttft is not None]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if any(values) else math.nan


@dataclass
class Tally:
    requests: int = 0
    ok: int = 0
    improper: int = 0  # 200 but not ended properly (an eviction notice is proper)
    evicted: int = 0  # 200 ended by an eviction notice
    refused: int = 0  # 429
    with_retry_after: int = 0  # of the 429s
    other: Counter[int] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)  # the 429s' error codes
    lost: Counter[str] = field(default_factory=Counter)

    @property
    def lost_count(self) -> int:
        return sum(self.lost.values())

    def line(self) -> str:
        text = f"{self.requests} requests: 200 {self.ok}"
        text += f" ({self.improper} not ended properly)" if self.improper else ""
        text += f" ({self.evicted} evicted)" if self.evicted else ""
        text += f", 429 {self.refused} (Retry-After on {self.with_retry_after}"
        text += f"; {dict(self.codes)})" if self.codes else ")"
        text += f", other {dict(self.other)}" if self.other else ""
        return text + f", LOST {self.lost_count}" + (f" {dict(self.lost)}" if self.lost else "")


def tally(results: list[Result], tenant: str | None = None) -> Tally:
    out = Tally()
    for r in results:
        if tenant is not None and r.tenant != tenant:
            continue
        out.requests += 1
        if r.lost is not None:
            out.lost[r.lost] += 1
        elif r.status == 200:
            out.ok += 1
            out.evicted += r.evicted
            out.improper += not (r.proper or r.evicted)
        elif r.status == 429:
            out.refused += 1
            out.with_retry_after += r.retry_after is not None
            out.codes[r.code or "?"] += 1
        else:
            out.other[r.status or 0] += 1
    return out


class Targets:
    """Every target checked, printed as it is."""

    def __init__(self) -> None:
        self.results: list[tuple[str, bool]] = []

    def check(self, ok: bool, target: str, value: str) -> None:
        self.results.append((target, ok))
        print(f"  {'PASS' if ok else 'FAIL'} {target}: {value}", flush=True)


# -- the stack ------------------------------------------------------------------------------


@dataclass
class Stack:
    config: TitoConfig
    process: subprocess.Popen[bytes]
    work: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.listener.port}"

    @property
    def admins(self) -> list[str]:
        return [f"http://127.0.0.1:{admin}" for _, admin in self.config.processor.worker_ports()]

    def states(self) -> list[dict[str, Any]]:
        """Every processor worker's /debug/state (raises if one does not answer)."""
        return [httpx.get(a + "/debug/state", timeout=5, trust_env=False).json() for a in self.admins]

    def engines(self) -> list[str]:
        instances = self.states()[0]["pools"]["union"]["instances"]
        return sorted(a for a, why in instances.items() if why == "routes")


def write_keys(path: Path) -> Path:
    tenants = [{"name": name, **spec, "keys": [hash_key(api_key(name))]} for name, spec in TENANTS.items()]
    path.write_text(yaml.safe_dump({"tenants": tenants}, sort_keys=False))
    return path


def stack_config(work: Path, redis: RedisServer) -> dict[str, Any]:
    """The bench's config: free ports, no `pools` (the default local pool)."""
    from ext_proc.tools.tiny_model import ensure_tiny_model
    from tests.conftest import free_port, free_ports

    processor = free_ports(2 * PROCESSORS)
    return {
        "listener": {
            "port": free_port(),
            "admin_port": free_port(),
            "engine_endpoints_file": str(work / "eds" / "engines.json"),
        },
        "processor": {"port": processor, "admin_port": processor + 1, "workers": PROCESSORS},
        "render_config": {"endpoint": {"port": free_port()}},
        "model": {"path": str(ensure_tiny_model(Path("~/.cache/tito").expanduser()))},
        "admission": {
            "global_token_budget": BUDGET,
            "queue_timeout_s": QUEUE_TIMEOUT_S,
            "queue_max_requests": QUEUE_MAX_REQUESTS,
            "flow_active_s": FLOW_ACTIVE_S,
            "evict_sheddable": True,
        },
        "tenancy": {
            "keys_file": str(write_keys(work / "keys.yaml")),
            "redis_url": redis.url,
            "redis_fail_mode": "local",
        },
        "local": {"cache_dir": str(work / "cache"), "kv_events_port": free_ports(2)},
    }


@contextlib.contextmanager
def tito_up(work: Path, redis: RedisServer) -> Iterator[Stack]:
    """`tito up` with the bench's config; `tito up`'s smoke request carries a tenant's key."""
    config = TitoConfig.model_validate(stack_config(work, redis))
    with running_up(config, work, {"TITO_API_KEY": api_key(SMOKE_TENANT)}) as process:
        stack = Stack(config, process, work)
        print(f"tito up: {stack.url}; logs in {run_dir(config) / 'logs'}, bench files in {work}", flush=True)
        yield stack


# -- watching the processors and the engine -------------------------------------------------


def worker_summary(state: dict[str, Any]) -> dict[str, Any]:
    flow = state["flow"]
    return {
        "queued": flow["requests"],
        "bands": {band: sum(f["requests"] for f in flows.values()) for band, flows in flow["bands"].items()},
        "flows": {name: f["requests"] for flows in flow["bands"].values() for name, f in flows.items()},
        "oldest_wait_s": flow["oldest_wait_s"],
        "shed": flow["shed"],
        "timed_out": flow["timed_out"],
        "evicted": flow["evicted"],
        "admitted_tokens": state["scheduler"]["total_active_tokens"],
        "active_requests": state["scheduler"]["active_requests"],
        "active_exchanges": state["active_exchanges"],
        "quota": state.get("quota"),
    }


def sample(stack: Stack, t: float) -> dict[str, Any]:
    """Every worker's /debug/state, summed up (a worker that does not answer: its error)."""
    workers: list[dict[str, Any]] = []
    for admin in stack.admins:
        try:
            workers.append(worker_summary(httpx.get(admin + "/debug/state", timeout=5, trust_env=False).json()))
        except (httpx.HTTPError, ValueError, KeyError) as error:
            workers.append({"error": f"{type(error).__name__}: {error}"})
    return {"t": round(t, 1), "workers": workers}


async def sample_states(stack: Stack, t0: float, stop: asyncio.Event, out: list[dict[str, Any]]) -> None:
    while not stop.is_set():
        out.append(await asyncio.to_thread(sample, stack, time.monotonic() - t0))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_S)


METRICS = {
    "tito_flow_requests_total",
    "tito_flow_queue_seconds_sum",
    "tito_flow_queue_seconds_count",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_queue_time_seconds_count",
}


def scrape(stack: Stack) -> Counter[tuple[str, str, str]]:
    """The processors' flow metrics and the engines' TTFT, summed: (name, band, outcome) -> value."""
    out: Counter[tuple[str, str, str]] = Counter()
    engines: list[str] = []
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        engines = stack.engines()
    for url in [a + "/metrics" for a in stack.admins] + [f"http://{e}/metrics" for e in engines]:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            text = httpx.get(url, timeout=5, trust_env=False).text
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name in METRICS:
                        out[(s.name, s.labels.get("band", ""), s.labels.get("outcome", ""))] += s.value
    return out


def core_ticks() -> list[tuple[int, int]]:
    """Each core's (busy, all) clock ticks from /proc/stat."""
    out = []
    for line in Path("/proc/stat").read_text().splitlines():
        name, *ticks = line.split()
        if name.startswith("cpu") and name != "cpu":
            values = [int(t) for t in ticks]
            out.append((sum(values) - values[3] - values[4], sum(values)))  # less idle and iowait
    return out


def busy_since(before: list[tuple[int, int]]) -> list[float]:
    """Each core's busy share since `before` (on 2 cores: what the engine leaves to the rest)."""
    return [(b - b0) / max(1, a - a0) for (b, a), (b0, a0) in zip(core_ticks(), before, strict=True)]


# -- phases ---------------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    results: list[Result]
    samples: list[dict[str, Any]]
    metrics: Counter[tuple[str, str, str]]  # what the phase added
    wall0: float
    seconds: float  # until the last request ended
    cpu: list[float] = field(default_factory=list)  # each core's busy share over the phase


class Bench:
    def __init__(self, stack: Stack, http: httpx.AsyncClient, redis: RedisServer, rounds: int) -> None:
        self.stack, self.http, self.redis = stack, http, redis
        self.rounds = rounds  # interleaved rounds of the fairness and priority phases
        self.clients = Clients()
        self.targets = Targets()
        self.states_file = stack.work / "states.jsonl"
        self.results_file = stack.work / "results.jsonl"  # every request's Result

    async def phase(
        self,
        name: str,
        loads: list[Load],
        seconds: float | None = None,
        requests: int | None = None,
        max_tokens: int = M,
        events: tuple[tuple[float, Callable[[], None]], ...] = (),
        settle: bool = True,
    ) -> Phase:
        """Closed-loop `loads` for `seconds` (or `requests` each), each tenant in its own client
        process, with `/debug/state` sampled meanwhile and `events` run at their times (seconds in)."""
        if settle:
            await self.settle()
        before = await asyncio.to_thread(scrape, self.stack)
        t0, wall0 = time.monotonic(), time.time()
        until = None if seconds is None else t0 + seconds
        stop, samples = asyncio.Event(), []
        sampler = asyncio.create_task(sample_states(self.stack, t0, stop, samples))
        timed = [asyncio.create_task(_at(t0 + at, action)) for at, action in events]
        ticks = core_ticks()
        runs = [self.clients.run(self.stack.url, load, max_tokens, t0, until, requests) for load in loads]
        results = [r for run in await asyncio.gather(*runs) for r in run]
        elapsed = time.monotonic() - t0
        cpu = busy_since(ticks)
        await asyncio.gather(*timed)
        stop.set()
        await sampler
        after = await asyncio.to_thread(scrape, self.stack)
        with self.states_file.open("a") as out:
            out.writelines(json.dumps({"phase": name, **s}) + "\n" for s in samples)
        with self.results_file.open("a") as out:
            out.writelines(json.dumps({"phase": name, **asdict(r)}) + "\n" for r in results)
        return Phase(name, results, samples, after - before, wall0, elapsed, cpu)

    async def settle(self) -> None:
        """The last phase's flows idle (`flow_active_s`) and nothing held by any worker."""
        await asyncio.sleep(FLOW_ACTIVE_S + 1)
        deadline = time.monotonic() + 60
        while any(any(held(s).values()) for s in await asyncio.to_thread(self.stack.states)):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)


async def _at(when: float, action: Callable[[], None]) -> None:
    await asyncio.sleep(max(0.0, when - time.monotonic()))
    await asyncio.to_thread(action)


def held(state: dict[str, Any]) -> dict[str, int]:
    """What a worker holds for requests in flight (all zero once every request ended)."""
    return {
        "flow_requests": state["flow"]["requests"],
        "active_exchanges": state["active_exchanges"],
        "admitted_tokens": state["scheduler"]["total_active_tokens"],
        "active_requests": state["scheduler"]["active_requests"],
        "open_http_streams": state["open_http_streams"],
    }


def print_statuses(phase: Phase, tenants: list[str]) -> None:
    print(f"  {phase.name} ({phase.seconds:.0f} s):", flush=True)
    for tenant in tenants:
        print(f"    {tenant}: {tally(phase.results, tenant).line()}", flush=True)


def print_time_spent(phase: Phase) -> None:
    """Where the time went: queued at admission (per band), the engine's TTFT, the samples."""
    m = phase.metrics
    bands = sorted({band for name, band, _ in m if band}, key=int, reverse=True)
    parts = []
    for band in bands:
        dispatched = m[("tito_flow_requests_total", band, "dispatched")]
        queued = m[("tito_flow_queue_seconds_count", band, "dispatched")]
        waited = m[("tito_flow_queue_seconds_sum", band, "dispatched")]
        refused = {o: int(v) for (n, b, o), v in m.items() if n == "tito_flow_requests_total" and b == band and v}
        refused.pop("dispatched", None)
        text = f"band {band}: {dispatched:.0f} dispatched, {queued:.0f} after queueing"
        text += f" (mean {waited / queued:.2f} s)" if queued else ""
        parts.append(text + (f", {refused}" if refused else ""))
    print(f"    admission queue: {'; '.join(parts) or 'nothing admitted'}", flush=True)
    engine = []
    for label, name in (("TTFT", "vllm:time_to_first_token_seconds"), ("queue", "vllm:request_queue_time_seconds")):
        count = m[(name + "_count", "", "")]
        if count:
            engine.append(f"{label} mean {ms(m[(name + '_sum', '', '')] / count)} over {count:.0f}")
    print(f"    engine (vLLM /metrics): {', '.join(engine) or 'no figures'}", flush=True)
    print(f"    /debug/state every {SAMPLE_S} s: {summarize_samples(phase.samples)}", flush=True)
    cores = ", ".join(f"core {i} {busy:.0%}" for i, busy in enumerate(phase.cpu))
    print(f"    CPU busy (the engine, the gateway and the clients): {cores}", flush=True)


def summarize_samples(samples: list[dict[str, Any]]) -> str:
    live = [[w for w in s["workers"] if "error" not in w] for s in samples]
    errors = sum(len(s["workers"]) - len(ws) for s, ws in zip(samples, live, strict=True))
    bands: dict[str, list[int]] = {}
    for workers in live:
        for band in {b for w in workers for b in w["bands"]}:
            bands.setdefault(band, []).append(sum(w["bands"].get(band, 0) for w in workers))
    queued = ", ".join(
        f"band {b} mean {sum(v) / len(live):.1f} max {max(v)}"
        for b, v in sorted(bands.items(), key=lambda x: -int(x[0]))
    )
    admitted = [w["admitted_tokens"] for ws in live for w in ws]
    oldest = max((w["oldest_wait_s"] for ws in live for w in ws), default=0.0)
    text = f"{len(samples)} samples; queued (all workers) {queued or 'none'}; oldest wait max {oldest:.2f} s"
    if admitted:
        text += f"; admitted tokens per worker mean {sum(admitted) / len(admitted):.0f} max {max(admitted)}"
        text += f" (share {BUDGET // PROCESSORS})"
    return text + (f"; {errors} worker answers missing" if errors else "")


# -- the scenarios --------------------------------------------------------------------------


async def measure_prompt(bench: Bench) -> int:
    """The prompt's tokens per the gateway's usage (the budget B is sized on them)."""
    t0 = time.monotonic()
    results = [await one_request(bench.http, bench.stack.url, SMOKE_TENANT, i, 1, t0) for i in range(PROMPTS)]
    counts = {r.tokens - 1 for r in results if r.ok}
    if not counts:
        raise RuntimeError(f"the prompt could not be measured: {[asdict(r) for r in results[:2]]}")
    biggest = max(counts)
    fits = BUDGET // PROCESSORS // (biggest + M)
    print(
        f"prompt tokens (gateway usage, 16 prompts): {sorted(counts)}; a request's demand {biggest + M} tokens",
        flush=True,
    )
    print(
        f"  B = {BUDGET} (4 x (prompt + {M}) = {4 * (biggest + M)}): each worker's share {BUDGET // PROCESSORS} holds {fits}"
    )
    return biggest


async def interleaved(
    bench: Bench, quiet: tuple[str, list[Load], float], loaded: tuple[str, list[Load], float], measured: str
) -> tuple[Phase, Phase]:
    """`bench.rounds` rounds of a quiet phase then a loaded one (ABAB: the machine's drift
    weighs on both alike), each round's `measured` TTFT printed; the rounds merged."""
    phases: dict[str, list[Phase]] = {quiet[0]: [], loaded[0]: []}
    for k in range(1, bench.rounds + 1):
        for name, loads, seconds in (quiet, loaded):
            phase = await bench.phase(f"{name} {k}", loads, seconds=seconds)
            phases[name].append(phase)
            t = ttfts(phase.results, measured)
            cores = ", ".join(f"{busy:.0%}" for busy in phase.cpu)
            print(
                f"  round {k} {name}: {measured} TTFT p50 {ms(pct(t, 0.5))}, p99 {ms(pct(t, 0.99))} over {len(t)};"
                f" cores busy {cores}",
                flush=True,
            )
    return merged(quiet[0], phases[quiet[0]]), merged(loaded[0], phases[loaded[0]])


def steady_ttfts(phase: Phase, tenant: str, joined_at: float) -> list[float]:
    """The TTFTs of `tenant`'s requests from `JOINED_S` after it joined a loaded phase; its
    requests before that are printed apart (they met the load's requests holding the budget)."""
    settled = joined_at + JOINED_S
    joining = ttfts([r for r in phase.results if r.start < settled], tenant)
    steady = ttfts([r for r in phase.results if r.start >= settled], tenant)
    print(f"    {tenant} joining (its first {JOINED_S} s in each round): TTFT {', '.join(ms(t) for t in joining)}")
    print(f"    {tenant} from then on (the target's figures): {len(steady)} requests", flush=True)
    return steady


def merged(name: str, phases: list[Phase]) -> Phase:
    metrics: Counter[tuple[str, str, str]] = Counter()
    for phase in phases:
        metrics.update(phase.metrics)
    cpu = [sum(c) / len(phases) for c in zip(*(phase.cpu for phase in phases), strict=True)]
    return Phase(
        f"{name}, {len(phases)} rounds",
        [r for phase in phases for r in phase.results],
        [s for phase in phases for s in phase.samples],
        metrics,
        phases[0].wall0,
        sum(phase.seconds for phase in phases),
        cpu,
    )


async def fairness(bench: Bench) -> None:
    print("\n== fairness ==", flush=True)
    alone, flood = await interleaved(
        bench,
        ("alone", [Load("quiet", 1)], ALONE_S),
        ("flood", [Load("noisy", 10), Load("quiet", 1, JOIN_S)], FLOOD_S),
        "quiet",
    )
    print_statuses(alone, ["quiet"])
    a = ttfts(alone.results, "quiet")
    a50, a99 = pct(a, 0.5), pct(a, 0.99)
    print(f"    quiet TTFT p50 {ms(a50)}, p99 {ms(a99)}", flush=True)
    print_time_spent(alone)

    print_statuses(flood, ["quiet", "noisy"])
    f = steady_ttfts(flood, "quiet", JOIN_S)
    f50, f99 = pct(f, 0.5), pct(f, 0.99)
    print(f"    quiet TTFT p50 {ms(f50)}, p99 {ms(f99)}; noisy TTFT p50 {ms(pct(ttfts(flood.results, 'noisy'), 0.5))}")
    print(f"    noisy served {tally(flood.results, 'noisy').ok} requests", flush=True)
    print_time_spent(flood)
    bench.targets.check(f50 / a50 <= 1.5, "quiet TTFT p50 beside the flood <= 1.5 x alone", f"{f50 / a50:.2f} x")
    bench.targets.check(f99 / a99 <= 1.5, "quiet TTFT p99 beside the flood <= 1.5 x alone", f"{f99 / a99:.2f} x")

    backlog = await bench.phase("backlogged", [Load("noisy", 12), Load("quiet", 6)], seconds=60)
    print_statuses(backlog, ["noisy", "quiet"])
    print_time_spent(backlog)
    served = {
        t: sum(r.tokens for r in backlog.results if r.tenant == t and r.ok and 10 <= r.end <= 50)
        for t in ("noisy", "quiet")
    }
    total = sum(served.values()) or 1
    shares = {t: v / total for t, v in served.items()}
    print(f"    tokens served, requests ended in 10-50 s: {served}", flush=True)
    for t, share in shares.items():
        bench.targets.check(
            0.45 <= share <= 0.55, f"{t}'s share of the tokens in [0.45, 0.55] (fair 0.5)", f"{share:.3f}"
        )
    index = jain([s / 0.5 for s in shares.values()])
    bench.targets.check(index >= 0.95, "Jain's index over share / fair share >= 0.95", f"{index:.4f}")


async def priority(bench: Bench) -> None:
    print("\n== priority ==", flush=True)
    unloaded, saturated = await interleaved(
        bench,
        ("unloaded", [Load("hi", 1)], UNLOADED_S),
        ("saturated", [Load("std", 8), Load("batch", 40), Load("hi", 1, SATURATE_S)], SATURATED_S),
        "hi",
    )
    print_statuses(unloaded, ["hi"])
    u99 = pct(ttfts(unloaded.results, "hi"), 0.99)
    print(f"    hi TTFT p50 {ms(pct(ttfts(unloaded.results, 'hi'), 0.5))}, p99 {ms(u99)}", flush=True)
    print_time_spent(unloaded)

    print_statuses(saturated, ["hi", "std", "batch"])
    s = steady_ttfts(saturated, "hi", SATURATE_S)
    s99 = pct(s, 0.99)
    print(f"    hi TTFT p50 {ms(pct(s, 0.5))}, p99 {ms(s99)}", flush=True)
    for t in ("std", "batch"):
        print(
            f"    {t} TTFT p50 {ms(pct(ttfts(saturated.results, t), 0.5))}, p99 {ms(pct(ttfts(saturated.results, t), 0.99))}"
        )
    print_time_spent(saturated)
    bench.targets.check(s99 / u99 <= 1.3, "hi TTFT p99 saturated <= 1.3 x unloaded", f"{s99 / u99:.2f} x")
    counts = {t: tally(saturated.results, t) for t in ("hi", "std", "batch")}
    out = {t: c.refused + c.evicted for t, c in counts.items()}
    bench.targets.check(
        out["hi"] + out["std"] == 0 and out["batch"] > 0,
        "batch shed before any other (429 or evicted: hi and std 0, batch > 0)",
        f"hi {out['hi']}, std {out['std']}, batch {out['batch']} (of which {counts['batch'].evicted} evicted)",
    )
    everything = tally(saturated.results)
    answered = everything.lost_count == 0 and everything.improper == 0
    answered = answered and everything.with_retry_after == everything.refused
    bench.targets.check(
        answered,
        "every request answered (LOST 0, every 200 ended properly or by its eviction notice, every 429 with Retry-After)",
        f"LOST {everything.lost_count}, improper {everything.improper}, "
        f"429 {everything.refused} of which {everything.with_retry_after} with Retry-After",
    )


def redis_counts(url: str) -> dict[int, int] | None:
    """Tokens charged to `metered` per minute window (its start), or None: Redis is down."""
    try:
        client = Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
        try:
            keys = list(client.scan_iter(match="tito:tpm:metered:*"))
            return {int(k.decode().rsplit(":", 1)[1]): int(client.get(k) or 0) for k in keys}
        finally:
            client.close()
    except (RedisError, OSError):
        return None


async def quota(bench: Bench) -> None:
    print("\n== quota ==", flush=True)
    await bench.settle()
    wait = WINDOW_S - time.time() % WINDOW_S + 0.2
    print(f"  waiting {wait:.0f} s for a minute window to start", flush=True)
    await asyncio.sleep(wait)
    charged: list[tuple[float, dict[int, int]]] = []  # (time.time(), Redis's counts)
    outage: dict[str, float] = {}  # time.time() of Redis's stop and start

    def stop_redis() -> None:
        if (counts := redis_counts(bench.redis.url)) is not None:
            charged.append((time.time(), counts))
        outage["stopped"] = time.time()
        bench.redis.stop()

    def start_redis() -> None:
        bench.redis.start()
        outage["started"] = time.time()

    stop = asyncio.Event()

    async def read_redis() -> None:
        while not stop.is_set():
            if (counts := await asyncio.to_thread(redis_counts, bench.redis.url)) is not None:
                charged.append((time.time(), counts))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), SAMPLE_S)

    reader = asyncio.create_task(read_redis())
    events = ((70.0, stop_redis), (100.0, start_redis))
    phase = await bench.phase("metered", [Load("metered", 4)], 130, max_tokens=QUOTA_M, events=events, settle=False)
    stop.set()
    await reader
    if (counts := redis_counts(bench.redis.url)) is not None:
        charged.append((time.time(), counts))
    into = {k: v - phase.wall0 for k, v in outage.items()}  # seconds into the phase
    seen = [(t - phase.wall0, c) for t, c in charged]
    print_statuses(phase, ["metered"])
    print(f"    Redis stopped at {into['stopped']:.1f} s, started again at {into['started']:.1f} s", flush=True)
    print_time_spent(phase)
    report_windows(bench, phase, seen, into)
    report_buckets(phase, into)
    report_outage(bench, phase, into)


def report_windows(
    bench: Bench, phase: Phase, charged: list[tuple[float, dict[int, int]]], outage: dict[str, float]
) -> None:
    first = math.ceil((phase.wall0 - 1) / WINDOW_S) * WINDOW_S
    end = phase.wall0 + phase.seconds
    for window in range(first, int(end) - WINDOW_S + 1, WINDOW_S):
        rel = max(0.0, window - phase.wall0)
        granted = [r for r in phase.results if r.ok and window <= r.wall < window + WINDOW_S]
        tokens = sum(r.tokens for r in granted)
        clock = time.strftime("%H:%M:%S", time.gmtime(window))
        seen = [(t, c[window]) for t, c in charged if window in c]
        down = rel < outage["started"] and outage["stopped"] < rel + WINDOW_S
        head = f"    window {clock} UTC ({rel:.0f}-{rel + WINDOW_S:.0f} s): client granted {tokens} tokens ({len(granted)} x 200)"
        if down:
            before = max((v for t, v in seen if t <= outage["stopped"]), default=0)
            after = max((v for t, v in seen if t >= outage["started"]), default=0)
            print(f"{head}; Redis charged {before} before its stop, {after} after its restart (it kept nothing)")
            print("      (Redis was down in this window: not a target)", flush=True)
            continue
        value = max((v for _, v in seen), default=0)
        print(f"{head}; Redis charged {value}", flush=True)
        bench.targets.check(
            0.95 <= value / TPM <= 1.0, f"window {clock}: charged / Q in [0.95, 1.0]", f"{value / TPM:.3f}"
        )


def report_buckets(phase: Phase, outage: dict[str, float]) -> None:
    buckets: Counter[int] = Counter()
    for r in phase.results:
        if r.ok:
            buckets[int(r.start // 10)] += r.tokens
    print("    granted tokens per 10 s (by request start):", flush=True)
    for b in range(max(buckets, default=0) + 1):
        lo, hi = b * 10, b * 10 + 10
        notes = []
        if (lo + phase.wall0) % WINDOW_S < 10:
            notes.append("a minute window starts")
        if lo <= outage["stopped"] < hi:
            notes.append("Redis stopped")
        if lo <= outage["started"] < hi:
            notes.append("Redis started")
        if outage["stopped"] < lo and hi <= outage["started"]:
            notes.append("Redis down")
        print(f"      {lo:3d}-{hi:3d} s: {buckets[b]:5d}  {', '.join(notes)}", flush=True)
    down = sum(r.tokens for r in phase.results if r.ok and outage["stopped"] <= r.start < outage["started"])
    print(
        f"    granted while Redis was down: {down} (fail mode local: each of {PROCESSORS} workers {TPM // PROCESSORS} a window)"
    )


def report_outage(bench: Bench, phase: Phase, outage: dict[str, float]) -> None:
    t = tally(phase.results)
    bench.targets.check(t.lost_count == 0, "no LOST request", str(t.lost_count))
    statuses = Counter(r.status for r in phase.results if r.lost is None)
    bench.targets.check(set(statuses) <= {200, 429}, "statuses only 200/429", str(dict(statuses)))
    during = [s for s in phase.samples if outage["stopped"] + 2 <= s["t"] < outage["started"] - 1]
    after = [s for s in phase.samples if s["t"] >= outage["started"] + 3]
    answered = all("error" not in w for s in during + after for w in s["workers"])
    bench.targets.check(
        answered and bool(during),
        "the processors still answer (/debug/state)",
        f"{len(during)} samples during the outage",
    )
    for name, samples, want in (("meanwhile", during, False), ("after", after, True)):
        ups = [[(w.get("quota") or {}).get("redis_up") for w in s["workers"]] for s in samples]
        seen = "; ".join(f"{s['t']:.0f} s {u}" for s, u in zip(samples, ups, strict=True))
        ok = bool(samples) and all(v == want for u in ups for v in u)
        bench.targets.check(ok, f"redis_up {want} {name} (every worker, every sample)", seen or "no sample")
    last = phase.samples[-1]["workers"] if phase.samples else []
    print(f"    quota state at the end: {[w.get('quota') for w in last]}", flush=True)


def report_leaks(bench: Bench) -> None:
    print("\n== the end: /debug/state once all requests ended ==", flush=True)
    deadline = time.monotonic() + 30
    while True:
        states = bench.stack.states()
        holds = [held(s) for s in states]
        if not any(any(h.values()) for h in holds) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for i, (state, h) in enumerate(zip(states, holds, strict=True)):
        flow = state["flow"]
        print(f"  worker {i}: {h}; flow shed {flow['shed']}, timed out {flow['timed_out']}; quota {state.get('quota')}")
    total = {k: sum(h[k] for h in holds) for k in holds[0]}
    bench.targets.check(
        not any(total.values()), "no leaks (flow requests, active exchanges, admitted tokens: all 0)", str(total)
    )


SCENARIOS = {"fairness": fairness, "priority": priority, "quota": quota}


async def run(stack: Stack, redis: RedisServer, scenarios: list[str], rounds: int) -> Targets:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=LOST_AFTER_S, limits=limits, trust_env=False) as http:
        bench = Bench(stack, http, redis, rounds)
        try:
            await bench.clients.warm(list(TENANTS))
            await measure_prompt(bench)
            for name in scenarios:
                await SCENARIOS[name](bench)
            await asyncio.sleep(1)
            await asyncio.to_thread(report_leaks, bench)
        finally:
            bench.clients.close()
    return bench.targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("scenario", nargs="?", default="all", choices=[*SCENARIOS, "all"])
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved rounds of fairness and priority")
    args = parser.parse_args(argv)
    scenarios = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    from tests.conftest import free_port

    work = Path(tempfile.mkdtemp(prefix="flow-bench-"))
    redis = RedisServer(work, free_port()).start()
    try:
        with tito_up(work, redis) as stack:
            targets = asyncio.run(run(stack, redis, scenarios, args.rounds))
    finally:
        redis.stop()
    passed = sum(ok for _, ok in targets.results)
    print(f"\ntargets: {passed} of {len(targets.results)} PASS", flush=True)
    return 0 if passed == len(targets.results) else 1


if __name__ == "__main__":
    sys.exit(main())
