"""The gRPC floor benchmark runs every server shape and event loop to the end; its timings are
printed, never asserted."""

from __future__ import annotations

import pytest

from tests.bench import grpc_bench


def test_every_case_answers_every_message(capsys: pytest.CaptureFixture[str]) -> None:
    for shape, loop in grpc_bench.CASES:
        us_per_message, rate = grpc_bench.measure(shape, messages=40, streams=2, loop=loop, pace_ms=1)
        assert us_per_message >= 0 and rate > 0  # _load returned only after every reply was read
    us_per_message, rate = grpc_bench.measure("outbox", 3, 20, "uvloop", one_by_one=True)
    assert us_per_message >= 0 and rate > 0  # every stream was answered and ended, one after another
    argv = ["--messages", "40", "--streams", "2", "--rounds", "1", "--pace-ms", "0", "--one-by-one", "20"]
    assert grpc_bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "outbox / minimal (asyncio)" in out and "outbox: uvloop / asyncio" in out
    assert "outbox on uvloop: set-up and end" in out and "sync on threads: set-up and end" in out
    assert "h2 on uvloop: set-up and end" in out and "outbox on uvloop: h2 / grpc.aio" in out
    assert "the floor, a TCP echo" in out
