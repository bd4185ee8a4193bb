"""One child process of `tito up` (a render sidecar, an engine, the processor, Envoy): started
in a process group of its own, so stopping it reaches the children it forks (vLLM's engine
core and workers), and its log kept in a file of its own.

Each process also gets a session of its own, except engines (`own_session=False`): Linux's
autogroup scheduling weighs a session as one group, and against a group whose tasks busy-wait
with `sched_yield` (a serving CPU engine's EngineCore and worker) another group's tasks on the
same core get almost no CPU. Two engines in sessions of their own on one core: one answered a
32-token completion in 0.14-0.21 s alone and not within 300 s while the other streamed 8
answers; in one session, 0.42-0.51 s (ext_proc/tools/cpu_affinity.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ManagedProcess:
    name: str
    command: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    own_session: bool = True  # else the session of `tito up` (engines: see above)
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=self.own_session,  # a session is a process group of its own too
                process_group=None if self.own_session else 0,  # stop() reaches vLLM's children
            )

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def stop(self, timeout: float = 15) -> None:
        if self.popen is None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5)):
            if self.popen.poll() is not None:
                break
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.popen.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):  # children (vLLM's workers) may outlive the leader
            os.killpg(self.popen.pid, signal.SIGKILL)

    def wait_group_gone(self, timeout: float = 10) -> bool:
        """After `stop()`: wait until no process of its group runs any more (SIGKILL is
        delivered at once, but the exit, and with it the release of the ports and memory the
        process held, is not). False on timeout; the caller goes on regardless."""
        if self.popen is None:
            return True
        deadline = time.monotonic() + timeout
        while group_running(self.popen.pid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def group_running(pgid: int) -> bool:
    """Some process of group `pgid` has not exited. Zombies do not count: they hold nothing,
    and orphans killed here are reaped by init (or stay zombies where no init reaps them),
    which `os.killpg(pgid, 0)` would count as running."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
