"""The gRPC floor benchmark runs both server shapes to the end; its timings are printed, never asserted."""

from __future__ import annotations

import pytest

from tests.bench import grpc_bench


def test_both_shapes_answer_every_message(capsys: pytest.CaptureFixture[str]) -> None:
    for shape in grpc_bench.SHAPES:
        us_per_message, rate = grpc_bench.measure(shape, messages=40, streams=2)
        assert us_per_message >= 0 and rate > 0  # _load returned only after every reply was read
    assert grpc_bench.main(["--messages", "40", "--streams", "2", "--rounds", "1"]) == 0
    assert "outbox / minimal" in capsys.readouterr().out
