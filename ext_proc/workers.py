"""`tito processor --workers N`: N processor processes on one host, each its own gRPC server
(and admin port) that Envoy balances streams over (`processor.worker_ports()`).

Why processes: one Python process tops out at a few thousand chunks/s (gRPC message handling
and derender share one interpreter). Every worker builds the same scheduler from the same
config and subscribes to the same engines' KV cache events, so their prefix indexes converge
on what the engines hold; each enforces its share of the admission budgets
(`TitoConfig.process_token_budgets`). This supervisor only starts, restarts and stops them.

It forks them: it imports what a worker imports (`cli.WORKER_MODULES`, 15 s of CPU on 2 cores:
vLLM's parsers and request models, torch, transformers) once, while it has no thread, loop or
socket yet, and each fork starts serving at once, a restarted one too, with those pages
shared among them. (Each started as a new process took the 15 s itself.)
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import logging
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

log = logging.getLogger("tito.workers")
RESTART_BACKOFF_S = (1.0, 30.0)  # a worker that keeps dying is restarted less and less often


def preload(modules: Sequence[str]) -> None:
    """Import `modules` (one that fails is left to the worker, which then reports it) and keep
    what they made out of later collections, so forks keep sharing its pages."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as error:
            log.debug("preloading %s: %r", module, error)
    gc.freeze()


class ForkedWorker:
    """A worker forked from this process, with the part of Popen the supervisor uses."""

    def __init__(self, run: Callable[[], int]) -> None:
        self.returncode: int | None = None
        # Blocked across the fork: a stop signal sent to a worker before it has its own
        # handlers waits for them instead of reaching the supervisor's copy and being lost.
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
        try:
            self.pid = os.fork()
            if self.pid == 0:  # the worker
                _run_worker(run)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)


_STOPS = {signal.SIGTERM, signal.SIGINT}


def _run_worker(run: Callable[[], int]) -> NoReturn:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the supervisor's handlers are not the worker's
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)
    exit_as_process(run)


def exit_as_process(run: Callable[[], int]) -> NoReturn:
    """End a forked child as `sys.exit(run())` ends an interpreter: its exit code (a
    traceback and 1 for an exception), its exit functions and logging shut down, its output
    flushed; and never back into the frames it was forked from."""
    code = 1
    try:
        code = run()
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


@dataclass
class _Worker:
    index: int
    popen: ForkedWorker | None = None
    started: float = 0.0
    delay_s: float = RESTART_BACKOFF_S[0]  # before the next restart
    due: float = 0.0  # when a dead worker is started again
    up: bool = False  # its gRPC port answered once

    def start(self, run: Callable[[int], int]) -> None:
        self.popen, self.started = ForkedWorker(lambda: run(self.index)), time.monotonic()

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


def supervise(
    run: Callable[[int], int], ports: list[tuple[str, int]], modules: Sequence[str] = (), poll_s: float = 0.2
) -> int:
    """Run `run(i)` in a fork for each worker until SIGTERM/SIGINT (its exit code: the fork's),
    restarting a worker that dies meanwhile (Envoy's health check keeps streams off it until
    it is back); then pass the signal on and wait for every worker to drain. 0 when all of them
    exited cleanly. `ports`: each worker's gRPC (host, port). One that exits before it ever
    served stops them all. `modules`: what a worker imports, imported here first."""
    preload(modules)
    stop = StopSignals()
    pool = [_Worker(i) for i in range(len(ports))]
    try:
        for worker in pool:
            worker.start(run)
        while not stop.requested:
            time.sleep(poll_s)
            if stop.requested:  # (the signal came during the sleep: the workers got it too)
                break
            for worker in pool:
                worker.up = worker.up or (worker.popen is not None and _serving(ports[worker.index]))
                if not worker.died() and worker.popen is None and time.monotonic() >= worker.due:
                    worker.start(run)
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
