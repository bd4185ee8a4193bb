"""`tito processor --workers N`: N processor processes on one host, each its own gRPC server
(and admin port) that Envoy balances streams over (`processor.worker_ports()`).

Why processes: one Python process tops out at a few thousand chunks/s (gRPC message handling
and derender share one interpreter). Every worker builds the same scheduler from the same
config and subscribes to the same engines' KV cache events, so their prefix indexes converge
on what the engines hold; each enforces its share of the admission budgets
(`TitoConfig.process_token_budgets`). This supervisor only starts, restarts and stops them.
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("tito.workers")
RESTART_BACKOFF_S = (1.0, 30.0)  # a worker that keeps dying is restarted less and less often


@dataclass
class _Worker:
    index: int
    popen: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    delay_s: float = RESTART_BACKOFF_S[0]  # before the next restart
    due: float = 0.0  # when a dead worker is started again
    up: bool = False  # its gRPC port answered once

    def start(self, command: Callable[[int], list[str]]) -> None:
        self.popen, self.started = subprocess.Popen(command(self.index)), time.monotonic()

    def died(self) -> bool:
        """Newly found dead: schedule the restart (a worker that lived a while gets the short
        delay again; one that keeps dying at start-up, longer and longer ones)."""
        if self.popen is None or (code := self.popen.poll()) is None:
            return False
        if not self.up:  # it never served: a config or install error, which restarts cannot fix
            raise WorkerFailed(f"processor worker {self.index} exited with code {code} before serving")
        lived = time.monotonic() - self.started
        self.delay_s = RESTART_BACKOFF_S[0] if lived > RESTART_BACKOFF_S[1] else self.delay_s
        log.warning("processor worker %d exited with code %s; restarting in %g s", self.index, code, self.delay_s)
        self.due, self.popen = time.monotonic() + self.delay_s, None
        self.delay_s = min(self.delay_s * 2, RESTART_BACKOFF_S[1])
        return True


class WorkerFailed(RuntimeError):
    pass


class StopSignals:
    """SIGTERM and SIGINT from now on only set `requested`: a supervising loop polls it and
    stops what it started in its own order."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)

    def _stop(self, signum: int, frame: object) -> None:
        self.requested = True


def supervise(command: Callable[[int], list[str]], ports: list[tuple[str, int]], poll_s: float = 0.2) -> int:
    """Run `command(i)` for each worker until SIGTERM/SIGINT, restarting a worker that dies
    meanwhile (Envoy's health check keeps streams off it until it is back); then pass the
    signal on and wait for every worker to drain. 0 when all of them exited cleanly.
    `ports`: each worker's gRPC (host, port). One that exits before it ever served stops them all."""
    stop = StopSignals()
    pool = [_Worker(i) for i in range(len(ports))]
    try:
        for worker in pool:
            worker.start(command)
        while not stop.requested:
            time.sleep(poll_s)
            if stop.requested:  # (the signal came during the sleep: the workers got it too)
                break
            for worker in pool:
                worker.up = worker.up or (worker.popen is not None and _serving(ports[worker.index]))
                if not worker.died() and worker.popen is None and time.monotonic() >= worker.due:
                    worker.start(command)
    except WorkerFailed as failed:
        log.error("%s; stopping the others", failed)
    finally:
        live = [w.popen for w in pool if w.popen is not None]
        for popen in live:
            popen.send_signal(signal.SIGTERM)
        codes = [popen.wait() for popen in live]
    log.info("processor workers exited: %s", codes)
    return 0 if stop.requested and all(code == 0 for code in codes) else 1


def _serving(address: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(address, timeout=0.2):
            return True
    except OSError:
        return False
