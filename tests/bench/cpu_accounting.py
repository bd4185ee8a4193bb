"""CPU seconds from /proc, for the benchmarks that say where a machine's CPU went."""

from __future__ import annotations

import os
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int, thread: int | None = None) -> list[str]:
    text = Path(f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()  # fields from 3 (state) on; comm may hold spaces


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads)."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def main_thread_cpu_seconds(pid: int) -> float:
    """utime + stime of a process's main thread alone (an asyncio process: its event loop)."""
    try:
        fields = _stat_fields(pid, thread=pid)
    except OSError:
        return 0.0  # gone meanwhile
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def group_cpu_by_pid(pgid: int) -> dict[int, float]:
    """CPU seconds of every live process in process group `pgid`: its own utime + stime (all its
    threads) plus cutime + cstime (children it reaped, e.g. a processor worker that died and was
    restarted meanwhile). A LocalStack process runs in a process group of its own (an engine in the stack's
    session, the others in sessions of their own), and what it starts without a new group stays
    in it: the processor supervisor's workers, vLLM's children."""
    ticks: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat_fields(int(entry.name))
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid:
            ticks[int(entry.name)] = sum(int(f) for f in fields[11:15]) / CLOCK_TICKS
    return ticks


def machine_cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine since boot, every core (/proc/stat: all but idle and iowait)."""
    try:
        fields = [int(f) for f in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    except (OSError, ValueError):
        return float("nan")
    return (sum(fields) - fields[3] - fields[4]) / CLOCK_TICKS


def own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system
