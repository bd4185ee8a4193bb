"""The benchmark runs and decides correctly; its timings are printed, never asserted."""

from __future__ import annotations

from tests.bench import scheduler_bench


def test_bench_runs_and_affinity_finds_the_cached_prompt() -> None:
    results = {r.name: r for r in scheduler_bench.run(iterations=3)}
    assert results["kv_cache_affinity"].chosen == "10.0.0.5:8000"
    assert all(r.us_per_decision > 0 for r in results.values())
