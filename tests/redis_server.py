"""A real Redis for the token quota and conversation store tests: redis-server on a free
loopback port, nothing saved to disk, stopped and started again on the same port to play an
outage (the `redis_server` fixture is in `tests/conftest.py`)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol


class RedisServer:
    def __init__(self, work: Path, port: int) -> None:
        self._dir = work / "redis"
        self._dir.mkdir(parents=True, exist_ok=True)
        self.port = port
        self._process: subprocess.Popen[bytes] | None = None
        self.log = work / "redis.log"

    @staticmethod
    def available() -> bool:
        return shutil.which("redis-server") is not None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "no", "--dir", str(self._dir)]
        with self.log.open("ab") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 5
        while not self._answers():
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(10)
            self._process = None

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False


class Closable(Protocol):
    async def close(self) -> None: ...


@contextlib.asynccontextmanager
async def closing(*closables: Closable) -> AsyncIterator[None]:
    """Each of them closed at the end (their Redis clients, their SQLite threads)."""
    try:
        yield
    finally:
        for closable in closables:
            await closable.close()
