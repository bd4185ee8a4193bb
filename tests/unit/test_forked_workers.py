"""`tito processor --workers N` forks its workers (ext_proc/workers.py): what a fork returns,
raises or dies of is its exit code as Popen would give it, and it never runs on in the
supervisor's frames."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable

import pytest

from ext_proc.workers import ForkedWorker


def _sleep() -> int:
    time.sleep(60)
    return 0


def _raise() -> int:
    raise RuntimeError("boom")


def _exit_3() -> int:
    sys.exit(3)


def _exit() -> int:
    sys.exit()


@pytest.mark.parametrize(("run", "code"), [(lambda: 0, 0), (lambda: 5, 5), (_exit_3, 3), (_exit, 0), (_raise, 1)])
def test_a_forks_exit_code_is_what_its_run_returned_or_raised(
    run: Callable[[], int], code: int, capfd: pytest.CaptureFixture[str]
) -> None:
    supervisor = os.getpid()
    worker = ForkedWorker(run)
    assert os.getpid() == supervisor  # only the supervisor gets here
    assert worker.wait() == code and worker.poll() == code
    if run is _raise:
        assert "RuntimeError: boom" in capfd.readouterr().err  # the worker's traceback


def test_a_signalled_fork_reads_as_popen_reads_it_and_polls_without_blocking() -> None:
    supervisors = signal.signal(signal.SIGTERM, lambda *_: None)  # as StopSignals sets it
    try:
        worker = ForkedWorker(_sleep)
    finally:
        signal.signal(signal.SIGTERM, supervisors)
    assert worker.poll() is None
    worker.send_signal(signal.SIGTERM)  # the supervisor's handler is not the worker's: it ends
    assert worker.wait() == -signal.SIGTERM
    worker.send_signal(signal.SIGTERM)  # reaped: nothing to signal, no error
