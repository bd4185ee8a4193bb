"""CPU placement of local CPU vLLM engines: an EngineCore process joins its workers' cores, and
engines that serve yield their CPU share to one that starts.

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
rest), so an engine that starts beside one that serves competes with it for them, and loses:
on 2 cores, beside an engine serving 64 streams, a starting engine's worker got 0-3 % of its
core (a CPU-bound process in a session of its own got 0 %), and the engine did not start in
10 minutes. Each engine runs in a session of its own, so Linux's autogroup scheduling weighs
it as one group. With the serving engine's group at nice 5 the starting worker still got 0 %;
at 19 it got 72 % and the serving engine's streams stalled; at 10 an engine starts in about a
minute beside 64 streams (restarts in 32-46 s beside 32). An autogroup's nice, unlike a
thread's, can be set back to 0 by its owner without privilege. (Engines that all serve share
their core unevenly too: with three on one core, one made 5000-7800 tokens/s and the others
under 15 for half a minute; the gateway relays what stalls.)
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

_PROC = Path("/proc")


def parent_pid(pid: int) -> int | None:
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm)": state, ppid, ...


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


# The nice value of a serving engine's autogroup while another engine starts (the lowest weight).
YIELDING_NICE = 10


def yield_cpu(session_leader: int, yielding: bool) -> bool:
    """Set the autogroup of the session `session_leader` leads (an engine: its API server,
    EngineCore and workers) to the lowest CPU weight, or back to the normal one. False where
    the kernel has no autogroups (or the process is gone): nothing changes there."""
    try:
        (_PROC / str(session_leader) / "autogroup").write_text(f"{YIELDING_NICE if yielding else 0}\n")
    except OSError:
        return False
    return True
