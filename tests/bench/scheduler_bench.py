"""Cost of one scheduling decision on a 32k-token prompt over 16 instances.

Prints µs per decision for each policy and the ratio to round robin (no prefix work) measured
in the same run, so the numbers compare across machines. Run: `python -m tests.bench.scheduler_bench`.

`--kv-events-blocks 1000000`: also the decision time with the event-fed prefix index
(`prefix_source="kv_events"`, the engines' own block hashes) holding that many blocks over
8 instances of block size 128 (the CPU engines'), filled through `Scheduler.kv_events` with
`BlockStored` events; a 2,000-token prompt whose prefix one instance holds. Baseline in the same
run: the same at 10,000 blocks (lookups are hash-map gets, so the ratio should be about 1).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from scheduler import (
    BlockHasher,
    BlockStored,
    KvCacheAffinity,
    LoadBalance,
    Policy,
    Pool,
    PrefixIndex,
    Rejection,
    Role,
    RoundRobin,
    Scheduler,
    ScheduleRequest,
    block_hashes,
)

PROMPT_TOKENS = 32_768
INSTANCES = 16
BLOCK = 16


@dataclass(frozen=True)
class Result:
    name: str
    us_per_decision: float
    chosen: str


def _prompts(rng: random.Random) -> tuple[list[int], list[list[int]]]:
    """The measured prompt, and a history of prompts sharing parts of its prefix."""
    prompt = [rng.randrange(150_000) for _ in range(PROMPT_TOKENS)]
    history = [prompt[: rng.randrange(BLOCK, PROMPT_TOKENS)] + [rng.randrange(150_000)] * 64 for _ in range(48)]
    return prompt, history


def _scheduler(policy: Policy, history: list[list[int]], home: int) -> Scheduler:
    pool = Pool.of("union", Role.UNION, [f"10.0.0.{n}:8000" for n in range(INSTANCES)])
    scheduler = Scheduler([pool], policy, prefix_index=PrefixIndex(BLOCK))
    for n, past in enumerate(history):
        address = pool.instances[home if n == 0 else n % INSTANCES].address
        scheduler.prefix_index.record(scheduler.prefix_index.hashes(past), address)
    return scheduler


def _time(decide: Callable[[int], str], iterations: int) -> tuple[float, str]:
    chosen = decide(-1)  # warm-up
    start = time.perf_counter()
    for n in range(iterations):
        chosen = decide(n)
    return (time.perf_counter() - start) / iterations * 1e6, chosen


def run(iterations: int = 200, seed: int = 7) -> list[Result]:
    rng = random.Random(seed)
    prompt, history = _prompts(rng)
    history[0] = prompt[: PROMPT_TOKENS - BLOCK]  # one instance holds almost the whole prompt
    results = []
    for name, policy in (
        ("round_robin", RoundRobin()),
        ("load_balance", LoadBalance()),
        ("kv_cache_affinity", KvCacheAffinity()),
    ):
        scheduler = _scheduler(policy, history, home=5)

        def decide(n: int, scheduler: Scheduler = scheduler) -> str:
            decision = scheduler.schedule(ScheduleRequest(f"r{n}", prompt, 256), 0.0)
            scheduler.finish(f"r{n}", 0.0)
            return decision.instance.address  # type: ignore[union-attr]

        us, chosen = _time(decide, iterations)
        results.append(Result(name, us, chosen))
    us, _ = _time(lambda n: str(block_hashes(prompt, BLOCK)[-1]), iterations)
    results.append(Result("hash_32k_prompt_only", us, "-"))
    return results


# -- decisions over the event-fed index ------------------------------------------------------

KV_INSTANCES = 8
KV_BLOCK = 128  # the CPU engines' block size (vLLM's default on CPUs)
KV_PROMPT_TOKENS = 2_000  # 15 full blocks
KV_HOME = 3  # the instance that holds most of the measured prompt's prefix
KV_HOME_BLOCKS = 12  # of its 15 full blocks (1,536 tokens)
KV_DECOY = 6  # holds a shorter prefix of it (4 blocks): the match has to tell them apart
KV_DECOY_BLOCKS = 4
KV_BASELINE_BLOCKS = 10_000
KV_EVENT_BLOCKS = 16  # hashes per BlockStored event (one 2k-token prompt's worth)
KV_BATCH_EVENTS = 64  # events per `Scheduler.kv_events` call (one ZMQ message's worth)
KV_HASHED_PROMPTS = 200  # filler prompts hashed for real (the rest: random 64-bit ints)


@dataclass(frozen=True)
class KvEventsResult:
    blocks: int  # in the index
    fill_s: float  # kv_events calls only (the filler hashes made beforehand)
    index_bytes: int  # the index's map, holder sets and hash ints (sys.getsizeof, deep)
    rss_bytes: int  # the process's resident set growth while filling (allocator overhead included)
    pick_us: list[float]  # per decision, sorted
    pick_commit_us: list[float]
    hash_us: list[float]  # BlockHasher.hashes of the prompt alone (part of every pick)
    chosen: str
    matched_tokens: int
    gc_collections: int  # full (generation 2) collections during the timed decisions

    @staticmethod
    def percentile(sorted_us: list[float], p: float) -> float:
        return sorted_us[min(len(sorted_us) - 1, int(p / 100 * len(sorted_us)))]


def _rss_bytes() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _index_bytes(index: PrefixIndex) -> int:
    """The map, each holder set and each hash int (the addresses are the instances' own strings)."""
    blocks = index._blocks  # noqa: SLF001 - a benchmark may look inside
    return sys.getsizeof(blocks) + sum(sys.getsizeof(h) + sys.getsizeof(holders) for h, holders in blocks.items())


def _kv_prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(150_000) for _ in range(KV_PROMPT_TOKENS)]


def _filler_events(rng: random.Random, blocks: int) -> list[list[BlockStored]]:
    """BlockStored events for `blocks` distinct blocks of other prompts, spread over the
    instances round robin (index i: instance i % KV_INSTANCES). The first KV_HASHED_PROMPTS
    prompts are hashed as the engines do (BlockHasher, SHA-256 of CBOR: ~20 µs a block); the
    bulk are random 64-bit ints, which is all the index ever sees of a block (a number), so
    filling a million blocks takes seconds, not minutes."""
    hasher = BlockHasher(KV_BLOCK)
    per_instance: list[list[BlockStored]] = [[] for _ in range(KV_INSTANCES)]
    made = 0
    n = 0
    while made < blocks:
        count = min(KV_EVENT_BLOCKS, blocks - made)
        if n < KV_HASHED_PROMPTS:
            tokens = [rng.randrange(150_000) for _ in range(count * KV_BLOCK)]
            hashes = tuple(hasher.hashes(tokens))
        else:
            hashes = tuple(rng.getrandbits(64) for _ in range(count))
        per_instance[n % KV_INSTANCES].append(BlockStored(hashes, KV_BLOCK))
        made += count
        n += 1
    return per_instance


def kv_events_scheduler(blocks: int, prompt: list[int], seed: int = 11) -> tuple[Scheduler, float, int]:
    """An event-fed scheduler whose index holds `blocks` blocks (the home instance's prefix of
    `prompt`, the decoy's shorter one, the rest filler); its fill time in seconds and RSS growth."""
    addresses = [f"10.0.1.{n}:8000" for n in range(KV_INSTANCES)]
    pool = Pool.of("union", Role.UNION, addresses, block_size=KV_BLOCK)
    scheduler = Scheduler(
        [pool], KvCacheAffinity(), prefix_index_max_blocks=max(1 << 20, blocks), prefix_source="kv_events"
    )
    for address in addresses:  # subscribed: commits leave the index to the events
        scheduler.feeds.subscribed(address, True)
    hashes = BlockHasher(KV_BLOCK).hashes(prompt)
    # The prefix's continuation on each instance: blocks of other prompts after the shared part.
    home = hashes[:KV_HOME_BLOCKS] + [random.Random(seed + 1).getrandbits(64) for _ in range(3)]
    decoy = hashes[:KV_DECOY_BLOCKS] + [random.Random(seed + 2).getrandbits(64) for _ in range(8)]
    own = len(set(home) | set(decoy))
    filler = _filler_events(random.Random(seed + 3), max(0, blocks - own))  # not the prompt's own tokens
    rss = _rss_bytes()
    start = time.perf_counter()
    scheduler.kv_events(addresses[KV_HOME], [BlockStored(tuple(home), KV_BLOCK)])
    scheduler.kv_events(addresses[KV_DECOY], [BlockStored(tuple(decoy), KV_BLOCK)])
    for n, events in enumerate(filler):
        for first in range(0, len(events), KV_BATCH_EVENTS):
            scheduler.kv_events(addresses[n], events[first : first + KV_BATCH_EVENTS])
    fill_s = time.perf_counter() - start
    del filler
    return scheduler, fill_s, _rss_bytes() - rss


def time_kv_decisions(scheduler: Scheduler, prompt: list[int], iterations: int) -> KvEventsResult:
    """p50/p99 of `pick`, and of `pick` + `commit`, for `prompt` (each lease released after,
    untimed, so every decision sees the same load); the index stays as the events made it."""
    requests = [ScheduleRequest(f"r{n}", prompt, 256) for n in range(iterations)]
    hasher = scheduler.prefix_index.hashes
    pick_us, commit_us, hash_us = [], [], []
    chosen, matched = "", 0
    clock = time.perf_counter_ns
    full_before = gc.get_stats()[2]["collections"]
    for request in requests:
        start = clock()
        picked = scheduler.pick(request, 0.0)
        picked_at = clock()
        assert not isinstance(picked, Rejection), picked
        scheduler.commit(picked)
        done = clock()
        pick_us.append((picked_at - start) / 1e3)
        commit_us.append((done - start) / 1e3)
        chosen, matched = picked.instance.address, picked.matched_tokens
        scheduler.finish(request.request_id, 0.0)
    for _ in range(min(iterations, 500)):
        start = clock()
        hasher(prompt)
        hash_us.append((clock() - start) / 1e3)
    full = gc.get_stats()[2]["collections"] - full_before
    blocks = len(scheduler.prefix_index)
    return KvEventsResult(blocks, 0.0, 0, 0, sorted(pick_us), sorted(commit_us), sorted(hash_us), chosen, matched, full)


def run_kv_events(blocks: int, iterations: int = 2_000, seed: int = 11) -> list[KvEventsResult]:
    """The 10k-block baseline, then `blocks`: each filled, timed and measured in turn."""
    prompt = _kv_prompt(random.Random(seed))
    results = []
    for size in (min(KV_BASELINE_BLOCKS, blocks), blocks):
        scheduler, fill_s, rss = kv_events_scheduler(size, prompt, seed)
        timed = time_kv_decisions(scheduler, prompt, iterations)
        index_bytes = _index_bytes(scheduler.prefix_index)
        results.append(replace(timed, fill_s=fill_s, index_bytes=index_bytes, rss_bytes=rss))
        del scheduler
        gc.collect()
    return results


def kv_events_report(results: list[KvEventsResult]) -> str:
    pct = KvEventsResult.percentile
    lines = [
        f"event-fed prefix index (prefix_source kv_events): {KV_INSTANCES} instances, block {KV_BLOCK}, "
        f"{KV_PROMPT_TOKENS}-token prompt; instance {KV_HOME} holds {KV_HOME_BLOCKS} of its blocks, "
        f"instance {KV_DECOY} {KV_DECOY_BLOCKS}; {len(results[-1].pick_us)} decisions per size",
        f"{'blocks':>10} {'fill s':>7} {'index MiB':>9} {'RSS MiB':>8} {'B/block':>7} {'pick p50':>9} "
        f"{'p99':>7} {'max':>8} {'pick+commit p50':>15} {'p99':>7} {'hash p50':>8} {'full GCs':>8}  chosen (matched tokens)",
    ]
    for r in results:
        lines.append(
            f"{r.blocks:>10,} {r.fill_s:>7.3f} {r.index_bytes / 2**20:>9.1f} {r.rss_bytes / 2**20:>8.1f} "
            f"{r.index_bytes / max(r.blocks, 1):>7.0f} {pct(r.pick_us, 50):>9.1f} {pct(r.pick_us, 99):>7.1f} "
            f"{r.pick_us[-1]:>8.1f} {pct(r.pick_commit_us, 50):>15.1f} {pct(r.pick_commit_us, 99):>7.1f} "
            f"{pct(r.hash_us, 50):>8.1f} {r.gc_collections:>8}  {r.chosen} ({r.matched_tokens})"
        )
    base, big = results[0], results[-1]
    lines.append(
        f"µs per decision; {big.blocks:,} blocks / {base.blocks:,}: pick p50 x{pct(big.pick_us, 50) / pct(base.pick_us, 50):.2f}, "
        f"p99 x{pct(big.pick_us, 99) / pct(base.pick_us, 99):.2f}; pick+commit p50 "
        f"x{pct(big.pick_commit_us, 50) / pct(base.pick_commit_us, 50):.2f}, "
        f"p99 x{pct(big.pick_commit_us, 99) / pct(base.pick_commit_us, 99):.2f} "
        f"(hashing the prompt, SHA-256 CBOR per block, is {pct(big.hash_us, 50) / pct(big.pick_us, 50):.0%} of a pick)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--kv-events-blocks", type=int, help="also: decisions over an event-fed index this big")
    parser.add_argument("--kv-events-iterations", type=int, default=2_000)
    args = parser.parse_args(argv)
    results = run()
    baseline = results[0].us_per_decision
    print(f"scheduling decision, {PROMPT_TOKENS}-token prompt, {INSTANCES} instances, block {BLOCK}")
    print(f"{'policy':<22}{'µs/decision':>14}{'× round_robin':>16}  chosen")
    for r in results:
        print(f"{r.name:<22}{r.us_per_decision:>14.1f}{r.us_per_decision / baseline:>16.2f}  {r.chosen}")
    if args.kv_events_blocks:
        print()
        print(kv_events_report(run_kv_events(args.kv_events_blocks, args.kv_events_iterations)))


if __name__ == "__main__":
    main()
