"""Cost of one scheduling decision on a 32k-token prompt over 16 instances.

Prints µs per decision for each policy and the ratio to round robin (no prefix work) measured
in the same run, so the numbers compare across machines. Run: `python -m tests.bench.scheduler_bench`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from scheduler import (
    KvCacheAffinity,
    LoadBalance,
    Policy,
    Pool,
    PrefixIndex,
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


def main() -> None:
    results = run()
    baseline = results[0].us_per_decision
    print(f"scheduling decision, {PROMPT_TOKENS}-token prompt, {INSTANCES} instances, block {BLOCK}")
    print(f"{'policy':<22}{'µs/decision':>14}{'× round_robin':>16}  chosen")
    for r in results:
        print(f"{r.name:<22}{r.us_per_decision:>14.1f}{r.us_per_decision / baseline:>16.2f}  {r.chosen}")


if __name__ == "__main__":
    main()
