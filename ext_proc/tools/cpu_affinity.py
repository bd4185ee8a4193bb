"""CPU placement of local CPU vLLM engines: an EngineCore process joins its workers' cores, all
engines run in one session, and engines that serve yield their CPU share to one that starts.

vLLM's CPU worker binds its OpenMP threads to the cores it computes on
(`VLLM_CPU_OMP_THREADS_BIND=auto`: all but one reserved core) and leaves the rest to the
system. Its EngineCore process is not bound, and while a batch runs it busy-waits for the
worker (`shm_broadcast`: `sched_yield` for a second after each read), so on a small machine it
takes a whole spare core away from the engine's own API server and from everything else.
Measured on 2 cores (8 concurrent 256-token streams, the engine alone, 3 x 8 rounds each
way): unbound, 12 of 24 rounds sent most of their events in one burst at the end, headers
included (E2E p50 up to 4.3 s); bound to the worker's core, 0 of 24 (E2E p50 0.87-1.56 s,
about what the even unbound rounds took: 0.94-1.39 s). The busy wait yields the core, so the
worker keeps it when it has work.

Every engine's workers are bound to the same cores (`auto` reserves the last one for the
rest), so engines on one machine share them. Linux's autogroup scheduling weighs each session
as one group, and against a group whose tasks busy-wait like these, another group's tasks on
that core got almost no CPU: in sessions of their own, an engine starting beside one that
served 64 streams got 0-3 % of its core and did not start in 10 minutes, and of two engines
that both served (2 cores, the tiny model), one answered a 32-token completion in 0.14-0.21 s
alone and not within 300 s while the other streamed 8 answers. With both engines in one
session (each in a process group of its own), it answered in 0.42-0.51 s: the tasks share the
core as tasks. So `tito up` starts its engines in its own session (managed_process.py).
(Bound to different cores, 0.14-0.21 s too, but on 2 cores that leaves none for the rest.)

Shared as tasks, a starting engine gets a third of the core beside a serving engine's worker
and EngineCore: under 16 streams a restart took 174-206 s (`fleet_soak chaos`). So while an
engine starts, the serving engines' tasks (every thread of every process in their process
groups) run at the stack's own nice + 10 (a tenth of the weight) and go back once it answers: restarts in
74-77 s under the same load. Setting a task's nice back down needs CAP_SYS_NICE (or an
RLIMIT_NICE that allows it); without it they are left as they are (`can_restore_nice`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

_PROC = Path("/proc")


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after "pid (comm)": state, ppid, pgrp, session, ..."""
    try:
        return (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def parent_pid(pid: int) -> int | None:
    fields = _stat(pid)
    return None if fields is None else int(fields[1])


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (a process tree walk over /proc)."""
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and (parent := parent_pid(int(entry.name))) is not None:
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return found


def _affinity(pid: int) -> set[int] | None:
    try:
        return os.sched_getaffinity(pid)
    except OSError:
        return None


def colocate_engine_core(engine_pid: int) -> dict[int, set[int]]:
    """Bind every thread of each EngineCore under the engine process `engine_pid` to the cores
    of its bound workers (the processes under it with an affinity narrower than the machine's).
    Returns {EngineCore pid: cores}; nothing when the workers are not bound."""
    machine = os.sched_getaffinity(0)
    cores: dict[int, set[int]] = {}
    for pid in descendants(engine_pid):
        bound, parent = _affinity(pid), parent_pid(pid)
        if bound is not None and bound < machine and parent is not None and parent != engine_pid:
            cores.setdefault(parent, set()).update(bound)
    for core_pid, cpus in cores.items():
        for task in (_PROC / str(core_pid) / "task").iterdir():
            with contextlib.suppress(OSError):  # a thread may end meanwhile
                os.sched_setaffinity(int(task.name), cpus)
    return cores


# How many nice levels a serving engine's tasks go down while another engine starts.
YIELDING_NICE = 10


def can_restore_nice() -> bool:
    """Whether this process may set a task's nice back after raising it: tried on a thread of
    its own (Linux's nice is per thread), so nothing else changes."""
    result: list[bool] = []

    def attempt() -> None:
        try:
            own = os.getpriority(os.PRIO_PROCESS, 0)
            os.setpriority(os.PRIO_PROCESS, 0, own + 1)
            os.setpriority(os.PRIO_PROCESS, 0, own)
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=attempt, name="nice-probe")
    thread.start()
    thread.join()
    return result == [True]


def group_tasks(pgid: int) -> list[int]:
    """Every thread of every process in process group `pgid`."""
    tasks: list[int] = []
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and (fields := _stat(entry.name)) is not None and int(fields[2]) == pgid:
            with contextlib.suppress(OSError):  # a process may end meanwhile
                tasks.extend(int(task.name) for task in (entry / "task").iterdir())
    return tasks


def yield_cpu(pgid: int, yielding: bool) -> bool:
    """Every task of the engine whose process group is `pgid` (its API server, EngineCore and
    workers) at this process's own nice (the one they started with) + `YIELDING_NICE`, or
    back at it. False when none was set (the group is gone)."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    nice = min(19, own + YIELDING_NICE) if yielding else own
    done = False
    for task in group_tasks(pgid):
        with contextlib.suppress(OSError):  # a thread may end meanwhile
            os.setpriority(os.PRIO_PROCESS, task, nice)
            done = True
    return done
