"""What `tito bench` (`ext_proc/tools/bench.py`) makes of its measurements: each side's
statistics (`SideStats`: percentiles pooled over the side's requests), the gateway-over-native
comparison (`BenchReport`, also as JSON) and the printed table. Pure functions of the results:
kept apart from the runner, which does the I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ext_proc.tools.bench_workload import BenchOptions


@dataclass(frozen=True)
class SideStats:
    side: str
    ok: int
    errors: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    gap_p50_ms: float
    gap_p99_ms: float
    gap_mean_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    chunks_per_request: float
    content_chunks_per_request: float
    tokens_per_s: float  # completion tokens of ok requests / time spent in this side's rounds
    error_samples: list[str]


@dataclass(frozen=True)
class BenchReport:
    options: BenchOptions
    sides: dict[str, SideStats]

    @property
    def e2e_p50_ratio(self) -> float:
        return ratio(self.sides["gateway"].e2e_p50_ms, self.sides["native"].e2e_p50_ms)

    @property
    def ttft_p50_diff_ms(self) -> float:
        return self.sides["gateway"].ttft_p50_ms - self.sides["native"].ttft_p50_ms

    @property
    def gap_p50_ratio(self) -> float:
        return ratio(self.sides["gateway"].gap_p50_ms, self.sides["native"].gap_p50_ms)

    @property
    def gap_mean_ratio(self) -> float:
        return ratio(self.sides["gateway"].gap_mean_ms, self.sides["native"].gap_mean_ms)

    @property
    def errors(self) -> int:
        return sum(s.errors for s in self.sides.values())

    def to_json(self) -> dict[str, Any]:
        """JSON-safe (NaN, e.g. a percentile of nothing, becomes null)."""
        report = {
            "options": asdict(self.options),
            "sides": {name: asdict(stats) for name, stats in self.sides.items()},
            "gateway_over_native": {
                "e2e_p50_ratio": self.e2e_p50_ratio,
                "ttft_p50_diff_ms": self.ttft_p50_diff_ms,
                "gap_p50_ratio": self.gap_p50_ratio,
                "gap_mean_ratio": self.gap_mean_ratio,
            },
            "errors": self.errors,
        }
        safe: dict[str, Any] = json_safe(report)
        return safe


def json_safe(value: Any) -> Any:
    """`value` with NaN floats (e.g. a percentile of nothing) as None, which JSON can carry."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def format_report(report: BenchReport) -> str:
    o = report.options
    workload = "tools + reasoning (structured_outputs regex)" if o.tools else "plain prompt"
    lines = [
        f"{o.api}, {o.concurrency} concurrent streams, max_tokens {o.max_tokens}, {o.requests} requests per side, "
        f"{workload}; gateway {o.gateway}, native {o.native}",
        f"{'side':<9}{'ok':>4}{'err':>4} |{'TTFT p50':>9}{'p99':>8} |{'gap p50':>8}{'p99':>8}{'mean':>8} |"
        f"{'E2E p50':>9}{'p99':>9} |{'chunks':>7}{'content':>8}{'tok/s':>8}",
    ]
    for s in report.sides.values():
        lines.append(
            f"{s.side:<9}{s.ok:>4}{s.errors:>4} |{s.ttft_p50_ms:>9.1f}{s.ttft_p99_ms:>8.1f} |"
            f"{s.gap_p50_ms:>8.2f}{s.gap_p99_ms:>8.2f}{s.gap_mean_ms:>8.2f} |{s.e2e_p50_ms:>9.1f}{s.e2e_p99_ms:>9.1f} |"
            f"{s.chunks_per_request:>7.1f}{s.content_chunks_per_request:>8.1f}{s.tokens_per_s:>8.0f}"
        )
    lines.append(
        "(ms; TTFT: to the first content-bearing chunk; gap: between content-bearing chunks; "
        "chunks, content: data events per request, all and content-bearing; tok/s: completion tokens per second "
        "of the side's rounds)"
    )
    lines.append(
        f"gateway/native: E2E p50 x{report.e2e_p50_ratio:.2f}, TTFT p50 {report.ttft_p50_diff_ms:+.1f} ms, "
        f"gap mean x{report.gap_mean_ratio:.2f}, gap p50 x{report.gap_p50_ratio:.2f}"
    )
    for s in report.sides.values():
        for sample in s.error_samples:
            lines.append(f"error ({s.side}) {sample}")
    return "\n".join(lines)
