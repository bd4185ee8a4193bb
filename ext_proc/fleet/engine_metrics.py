"""Each engine's own load, from its Prometheus `/metrics`, into the scheduler
(`scheduler.load_source: engine_metrics`; the combination is `scheduler/engine_load.py`).

Per instance: `GET http://<address>/metrics` every `engine_metrics_interval_s` on the
processor's HTTP client. Of vLLM 0.32's exposition only four families are read, summed over
their label sets (one per engine core of a data-parallel server): running and waiting
requests, KV cache usage (0..1) and the cache's size, `num_gpu_blocks × block_size` from the
labels of `vllm:cache_config_info`. A poll that fails (refused, timed out, not 200, nothing
readable) feeds nothing: the last sample goes stale and ranking falls back to the ledger. That
is logged when polls start failing and when they recover, never once per poll.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

import httpx

from scheduler import EngineLoad, Scheduler

log = logging.getLogger("tito.engine_metrics")

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_INFO = "vllm:cache_config_info"
_FAMILIES = (RUNNING, WAITING, KV_USAGE, CACHE_INFO)
# `name{labels} value`: a label value may hold '}' or ',', so labels are read pairwise
_SAMPLE = re.compile(r"([\w:]+)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def sample_labels(line: str) -> dict[str, str]:
    """The labels of one exposition line (empty when it is not a sample)."""
    match = _SAMPLE.fullmatch(line)
    return dict(_LABEL.findall(match[2] or "")) if match is not None else {}


class MetricsUnreadable(ValueError):
    pass


def parse_engine_metrics(text: str, at: float) -> EngineLoad:
    """One sample from an engine's exposition text; MetricsUnreadable without the families it needs."""
    requests = {RUNNING: 0.0, WAITING: 0.0}
    usage: dict[str, float] = {}  # per engine core
    capacity: dict[str, int] = {}
    seen: set[str] = set()
    for line in text.splitlines():
        # the prefix test skips the hundreds of histogram lines cheaply; the branches below
        # test exact names (vllm:num_requests_waiting_by_reason shares a prefix)
        match = _SAMPLE.fullmatch(line) if line.startswith(_FAMILIES) else None
        if match is None:
            continue
        name, labels, value = match[1], dict(_LABEL.findall(match[2] or "")), float(match[3])
        seen.add(name)
        engine = labels.get("engine", "")
        if name in requests:
            requests[name] += value
        elif name == KV_USAGE:
            usage[engine] = value
        elif name == CACHE_INFO and (tokens := _capacity(labels)) is not None:
            capacity[engine] = tokens
    missing = {RUNNING, WAITING, KV_USAGE} - seen
    if missing:
        raise MetricsUnreadable(f"no {', '.join(sorted(missing))}")
    kv_usage, kv_capacity = _kv_cache(usage, capacity)
    return EngineLoad(round(requests[RUNNING]), round(requests[WAITING]), kv_usage, kv_capacity, at)


def _capacity(cache_config: dict[str, str]) -> int | None:
    """Tokens the KV cache holds, from `vllm:cache_config_info`'s labels (None: not sized yet)."""
    blocks, size = cache_config.get("num_gpu_blocks", ""), cache_config.get("block_size", "")
    return int(blocks) * int(size) if blocks.isdigit() and size.isdigit() else None


def _kv_cache(usage: dict[str, float], capacity: dict[str, int]) -> tuple[float, int | None]:
    """Usage over all engine cores (weighted by their sizes) and their total size; a size
    only when every core reports one."""
    total = sum(capacity.get(engine, 0) for engine in usage)
    if usage.keys() <= capacity.keys() and total:
        return sum(u * capacity[engine] for engine, u in usage.items()) / total, total
    return sum(usage.values()) / len(usage), None


class EngineMetricsPoller:
    def __init__(
        self, address: str, scheduler: Scheduler, http: httpx.AsyncClient, interval_s: float, timeout_s: float
    ) -> None:
        self.address = address
        self._url = f"http://{address}/metrics"
        self._scheduler = scheduler
        self._http = http
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self.failing = False

    async def run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self._interval_s)

    async def poll(self) -> None:
        at = time.monotonic()  # the scheduler's clock; the engine's state is at least this old
        try:
            response = await self._http.get(self._url, timeout=self._timeout_s)
            if response.status_code != 200:
                raise MetricsUnreadable(f"HTTP {response.status_code}")
            load = parse_engine_metrics(response.text, at)
        except (httpx.HTTPError, ValueError) as exc:
            if not self.failing:
                log.warning("metrics of %s: %s: %s; its load is the ledger's", self.address, type(exc).__name__, exc)
            self.failing = True
            return
        if self.failing:
            log.info("metrics of %s: readable again", self.address)
        self.failing = False
        self._scheduler.engine_load(self.address, load)
