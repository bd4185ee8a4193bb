"""`tito up` puts a CPU engine's EngineCore on its bound worker's cores (ext_proc/tools/cpu_affinity.py),
shown on a real process tree shaped like vLLM's: API server -> EngineCore (two threads) -> worker
bound to one core."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from ext_proc.tools.cpu_affinity import (
    YIELDING_NICE,
    can_restore_nice,
    colocate_engine_core,
    descendants,
    group_tasks,
    parent_pid,
    yield_cpu,
)

# The "EngineCore": a second thread, then a "worker" that binds itself to the first core (when
# the API server's argument says so) and says it is ready on stdout; all sleep until killed.
WORKER = """
import os, sys, time
if sys.argv[1] == "bind":
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
print("ready", flush=True)
time.sleep(60)
"""
ENGINE_CORE = f"""
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
subprocess.Popen([sys.executable, "-c", {WORKER!r}, sys.argv[1]])
time.sleep(60)
"""
API_SERVER = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {ENGINE_CORE!r}, sys.argv[1]]); time.sleep(60)"


def _tasks(pid: int) -> list[int]:
    return [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]


@contextlib.contextmanager
def engine_tree(worker: str) -> Iterator[int]:
    """The API server's pid, once its worker is up (bound to one core, or not: `worker`); in
    this session, in a process group of its own, as `tito up` starts an engine."""
    api = subprocess.Popen(
        [sys.executable, "-c", API_SERVER, worker], stdout=subprocess.PIPE, text=True, process_group=0
    )
    try:
        assert api.stdout is not None and api.stdout.readline().strip() == "ready"
        yield api.pid
    finally:
        os.killpg(api.pid, signal.SIGKILL)
        api.wait()


def test_the_engine_core_joins_its_bound_worker() -> None:
    machine = os.sched_getaffinity(0)
    with engine_tree("bind") as api:
        core = _engine_core(api)
        assert len(_tasks(core)) >= 2 and all(os.sched_getaffinity(t) == machine for t in _tasks(core))

        # On one core the worker's binding is the whole machine: nothing to move.
        assert colocate_engine_core(api) == ({core: {min(machine)}} if len(machine) > 1 else {})

        assert all(os.sched_getaffinity(t) == {min(machine)} for t in _tasks(core))  # every thread, not the first only
        assert os.sched_getaffinity(api) == machine  # the API server stays free


def test_unbound_workers_leave_everything_as_it_was() -> None:
    machine = os.sched_getaffinity(0)
    with engine_tree("free") as api:
        assert colocate_engine_core(api) == {}
        assert all(os.sched_getaffinity(t) == machine for t in _tasks(_engine_core(api)))


def test_an_engine_yields_its_cpu_share_and_takes_it_back() -> None:
    """Every thread of every process in the engine's group (API server, EngineCore, worker),
    and nothing outside it; the nice goes back to 0 only with the privilege to lower it."""
    with engine_tree("bind") as api:
        tasks = group_tasks(api)
        assert set(tasks) >= {*_tasks(api), *_tasks(_engine_core(api))} and len(tasks) >= 4  # the worker too
        assert yield_cpu(api, True)
        assert {os.getpriority(os.PRIO_PROCESS, t) for t in tasks} == {YIELDING_NICE}
        assert os.getpriority(os.PRIO_PROCESS, 0) == 0  # the stack itself keeps its share
        if can_restore_nice():
            assert yield_cpu(api, False)
            assert {os.getpriority(os.PRIO_PROCESS, t) for t in tasks} == {0}
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert not yield_cpu(int(ended.stdout), True)  # no such group: nothing set


def _engine_core(api: int) -> int:
    """The API server's child (its grandchild is the worker)."""
    return next(p for p in descendants(api) if parent_pid(p) == api)
