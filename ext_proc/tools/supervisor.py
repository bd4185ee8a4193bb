"""`tito up`'s restart policy: which child processes come back when they exit, and when.

Pure bookkeeping (no processes, no sleeping: every call takes the clock), so the policy is
unit-tested apart from the processes it governs (`tests/unit/test_supervisor.py`). The
processor's own worker supervisor (`ext_proc/workers.py`) backs off the same way.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Backoff:
    """Delay before restart n: `initial_s` doubling up to `max_s`. A process that stayed up
    `stable_s` had a transient failure: its next exit starts from `initial_s` again, while one
    that keeps dying at start-up (a bad flag, a port held elsewhere) is retried less and less."""

    initial_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 60.0

    def delay_s(self, attempt: int) -> float:
        return min(self.initial_s * 2.0 ** (attempt - 1), self.max_s)


@dataclass(frozen=True)
class Restart:
    """A restart scheduled: the `attempt`-th since the process last stayed up, `delay_s` after
    its exit, at `due` (on the caller's clock)."""

    name: str
    attempt: int
    delay_s: float
    due: float


@dataclass
class _History:
    started: float
    attempts: int = 0  # restarts since the process last stayed up `stable_s`
    due: float | None = None  # set while it waits to be started again


class RestartPolicy:
    """Per process: `started` when (re)started, `exited` when found dead (schedules the
    restart), `due` lists whose restart time has come. A process that is not `restartable`
    ends the stack when it exits (`ends_stack`)."""

    def __init__(self, restartable: Iterable[str], backoff: Backoff | None = None) -> None:
        self._restartable = frozenset(restartable)
        self._removed: frozenset[str] = frozenset()  # stopped on purpose: their exit means nothing
        self.backoff = backoff or Backoff()
        self._history: dict[str, _History] = {}

    def add(self, name: str, now: float) -> None:
        """A process started while the stack runs (an engine `tito scale` added): restarted too."""
        self._restartable |= {name}
        self._removed -= {name}
        self.started(name, now)

    def remove(self, name: str) -> None:
        """A process stopped on purpose (`tito scale` down): neither restarted nor fatal."""
        self._restartable -= {name}
        self._removed |= {name}
        self._history.pop(name, None)

    def restartable(self, name: str) -> bool:
        return name in self._restartable

    def ends_stack(self, dead: Iterable[str]) -> bool:
        """Any exited process that is not restarted ends the stack; restartable ones never do,
        not even all of them at once (they come back; meanwhile the gateway's breakers, and
        the local tokenizer for render, carry the requests)."""
        return any(not self.restartable(name) and name not in self._removed for name in dead)

    def started(self, name: str, now: float) -> None:
        history = self._history.setdefault(name, _History(started=now))
        history.started, history.due = now, None

    def waiting(self, name: str) -> bool:
        """Its exit is known and its restart scheduled (so it is not counted twice)."""
        history = self._history.get(name)
        return history is not None and history.due is not None

    def exited(self, name: str, now: float) -> Restart:
        if not self.restartable(name):
            raise ValueError(f"{name} is not restarted")
        history = self._history.setdefault(name, _History(started=now))
        if now - history.started >= self.backoff.stable_s:
            history.attempts = 0
        history.attempts += 1
        delay = self.backoff.delay_s(history.attempts)
        history.due = now + delay
        return Restart(name, history.attempts, delay, history.due)

    def due(self, now: float) -> list[str]:
        return sorted(name for name, h in self._history.items() if h.due is not None and now >= h.due)


def exit_status(code: int | None) -> str:
    """How a process ended, as Popen reports it (a negative code is the signal that killed it)."""
    if code is None:
        return "no exit code (it did not start)"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def restart_line(restart: Restart, code: int | None, log_path: Path) -> str:
    """The stderr line for one scheduled restart."""
    return (
        f"{restart.name} exited with {exit_status(code)}; restart {restart.attempt} "
        f"in {restart.delay_s:g} s (log: {log_path})"
    )
