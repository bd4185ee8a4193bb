"""The benchmark runs and decides correctly; its timings are printed, never asserted."""

from __future__ import annotations

from tests.bench import scheduler_bench


def test_bench_runs_and_affinity_finds_the_cached_prompt() -> None:
    results = {r.name: r for r in scheduler_bench.run(iterations=3)}
    assert results["kv_cache_affinity"].chosen == "10.0.0.5:8000"
    assert all(r.us_per_decision > 0 for r in results.values())


def test_kv_events_bench_fills_the_index_and_finds_the_instance_holding_the_prefix() -> None:
    """The `--kv-events-blocks` path at 20k blocks: the index holds exactly that many (fed by
    BlockStored events), and every decision goes to the instance with the longest prefix."""
    baseline, big = scheduler_bench.run_kv_events(20_000, iterations=5)
    assert (baseline.blocks, big.blocks) == (scheduler_bench.KV_BASELINE_BLOCKS, 20_000)
    for result in (baseline, big):
        assert result.chosen == f"10.0.1.{scheduler_bench.KV_HOME}:8000"
        assert result.matched_tokens == scheduler_bench.KV_HOME_BLOCKS * scheduler_bench.KV_BLOCK
        assert len(result.pick_us) == len(result.pick_commit_us) == 5
        assert result.index_bytes > 0
    assert "20,000" in scheduler_bench.kv_events_report([baseline, big])
