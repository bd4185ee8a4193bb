"""The benchmarks' /proc accounting tells a process's main thread (an asyncio process's event
loop) from its other threads."""

from __future__ import annotations

import os
import threading
import time

from tests.bench.cpu_accounting import main_thread_cpu_seconds, process_cpu_seconds

SPIN_S = 0.3


def _spin() -> None:
    end = time.thread_time() + SPIN_S
    while time.thread_time() < end:
        pass


def test_helper_threads_count_for_the_process_not_for_its_main_thread() -> None:
    pid = os.getpid()
    main, whole = main_thread_cpu_seconds(pid), process_cpu_seconds(pid)
    helper = threading.Thread(target=_spin)
    helper.start()
    helper.join()
    assert main_thread_cpu_seconds(pid) - main < SPIN_S / 3  # the main thread only waited
    assert process_cpu_seconds(pid) - whole >= SPIN_S * 0.8  # clock ticks: allow rounding

    main = main_thread_cpu_seconds(pid)
    _spin()
    assert main_thread_cpu_seconds(pid) - main >= SPIN_S * 0.8
