"""`tito bench` runs against the real stack and checks every stream; timings are printed, never asserted."""

from __future__ import annotations

import json

import pytest

from ext_proc.tools import bench
from ext_proc.tools.bench_report import percentile
from tests.conftest import RunningStack


def _args(stack: RunningStack, *extra: str) -> list[str]:
    return [
        "--gateway",
        stack.base_url,
        "--native",
        stack.engine_url,
        "--concurrency",
        "2",
        "--max-tokens",
        "8",
        "--requests",
        "2",
        *extra,
    ]


def test_bench_compares_gateway_with_native(stack: RunningStack, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(_args(stack)) == 0
    out = capsys.readouterr().out
    assert "gateway/native: E2E p50 x" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("gateway ", "native "))]
    assert [(r[0], r[1], r[2]) for r in rows] == [("gateway", "2", "0"), ("native", "2", "0")]  # ok, errors
    assert "error (" not in out


def test_bench_json_with_tools(stack: RunningStack, capsys: pytest.CaptureFixture[str]) -> None:
    """The tools + reasoning workload goes through both sides, each stream checked (one [DONE],
    completion_tokens == max_tokens)."""
    assert bench.main(_args(stack, "--tools", "--json")) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["errors"] == 0
    assert {side: s["ok"] for side, s in report["sides"].items()} == {"gateway": 2, "native": 2}
    assert set(report["gateway_over_native"]) >= {"e2e_p50_ratio", "ttft_p50_diff_ms"}


def test_sse_framing_and_content_bearing() -> None:
    events = bench.SseEvents()
    assert events.feed(b'data: {"a":1}\r\n\r\ndata:{"b"') == [b'{"a":1}']
    assert events.feed(b":2}\r") == []  # the CR may be half of a CRLF
    assert events.feed(b"\n\r\ndata: [DONE]\n\n") == [b'{"b":2}', b"[DONE]"]
    assert bench.content_bearing({"choices": [{"delta": {"reasoning": "hm"}}]})
    assert bench.content_bearing({"choices": [{"text": "x"}]})
    assert not bench.content_bearing({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert not bench.content_bearing({"choices": [], "usage": {"completion_tokens": 8}})
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
