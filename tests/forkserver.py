"""Processors for the tests, forked from a warm parent instead of started afresh.

A processor spends 15-16 s of CPU importing vLLM, torch and transformers before it listens
(`-X importtime`: `vllm.parser` alone pulls in `import vllm`, 7.4 s, and its abstract parser,
6.7 s), and the suite starts about ninety of them. This server imports them once; each
processor the tests start is a fork of it that runs `python -m ext_proc.cli ...` from there:
the same code and command line, in a session of its own with its own log, but listening within
a second or two.

Only `ext_proc.cli processor` commands come here (`fork_popen`); every other command, and
`tito up` (the product's own path, as a newcomer runs it), is started as it always was. The
server forks from a single thread that has only imported modules: no event loop, channel or
thread pool exists yet to be copied half-made into a child.

The protocol, one connection per child: the client sends one JSON line (argv, env, cwd, log
path); the server answers one line with the child's pid, and later one line with how it ended
(a Popen-style code: negative for the signal that killed it), then closes.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

MODULE = "ext_proc.cli"


def forkable(command: list[str]) -> bool:
    """`python -m ext_proc.cli ... processor ...` with this interpreter."""
    return command[:3] == [sys.executable, "-m", MODULE] and "processor" in command[3:]


# -- the server (its own process) ----------------------------------------------------------


def serve(path: str) -> None:
    # What a processor has imported by the time it listens, the lazy imports of its start
    # included (the processor's own supervisor forks its workers from the same)
    from ext_proc.cli import WORKER_MODULES
    from ext_proc.workers import preload

    preload(WORKER_MODULES)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # the path appears when it accepts
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    while True:
        for _ in selector.select(timeout=0.05):
            connection, _ = listener.accept()
            try:
                request = json.loads(connection.makefile("rb").readline())
                pid = _fork(request, [listener, connection, *children.values()], selector)
                connection.sendall(f"{pid}\n".encode())
            except (OSError, ValueError) as error:  # the client reads the end of the connection
                print(f"a fork request failed: {error!r}", flush=True)
                connection.close()
                continue
            children[pid] = connection
        _reap(children)


def _fork(request: dict[str, Any], sockets: list[socket.socket], selector: selectors.BaseSelector) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        selector.close()
        for held in sockets:  # (a child must not keep another child's connection open)
            held.close()
        _child(request)  # never returns
    return pid


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            with contextlib.suppress(OSError):
                connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            connection.close()


def _child(request: dict[str, Any]) -> NoReturn:
    """What `subprocess.Popen(argv, stdout=log, stderr=STDOUT, stdin=DEVNULL, env=env,
    start_new_session=True)` would have made, from here on."""

    def run() -> int:
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [MODULE.replace(".", "/") + ".py", *request["argv"][3:]]
        from ext_proc.cli import main  # (`python -m ext_proc.cli` runs `sys.exit(main())`)

        return main()

    from ext_proc.workers import exit_as_process

    exit_as_process(run)


# -- the client (in the test process) ------------------------------------------------------


class ForkedPopen:
    """The part of `subprocess.Popen` that ManagedProcess and the tests use, for a child of the
    fork server (not of this process: its end is learnt from the server)."""

    def __init__(self, connection: socket.socket, args: list[str]) -> None:
        self.args = args
        self._connection = connection
        self._buffer = b""
        self.returncode: int | None = None
        self.pid = int(self._line(None) or b"0")
        if not self.pid:
            raise RuntimeError("the fork server did not fork: see its log")

    def poll(self) -> int | None:
        if self.returncode is None:
            self._ended(self._line(0.0))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._ended(self._line(timeout))
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _line(self, timeout: float | None) -> bytes | None:
        """The server's next line; None if none came within `timeout`; b"" if it closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._connection], [], [], left)[0]:
                return None
            chunk = self._connection.recv(256)
            if not chunk:
                return b""
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _ended(self, line: bytes | None) -> None:
        if line is None:
            return
        self.returncode = int(line) if line else -signal.SIGKILL  # (the server is gone: so is its child)
        self._connection.close()


class ForkServer:
    def __init__(self, work: Path) -> None:
        self.path = str(work / "forkserver.sock")
        self.log_path = work / "forkserver.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> ForkServer:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-c", f"from tests.forkserver import serve; serve({self.path!r})"],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + 300
        while not os.path.exists(self.path):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the fork server did not start:\n" + self.log_path.read_text(errors="replace"))
            time.sleep(0.1)
        return self

    def popen(self, command: list[str], log_path: Path, env: dict[str, str]) -> ForkedPopen:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(self.path)
        request = {"argv": command, "env": env, "cwd": os.getcwd(), "log": str(log_path)}
        connection.sendall(json.dumps(request).encode() + b"\n")
        return ForkedPopen(connection, command)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # (its children run in sessions of their own)
            self.process.wait(10)
