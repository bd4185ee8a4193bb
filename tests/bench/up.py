"""`tito up` for a bench: its config written beside its log, running until its smoke request
has answered, stopped with SIGTERM to its process group at the end."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import yaml

from ext_proc.config import TitoConfig
from ext_proc.tools.local_stack import run_dir


@contextlib.contextmanager
def running_up(config: TitoConfig, work: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    path = work / "tito.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    log_path = work / "up.log"
    command = [sys.executable, "-m", "ext_proc.cli", "--config", str(path), "up"]
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})}
        )
        try:
            deadline = time.monotonic() + 600
            while "smoke request ->" not in log_path.read_text():
                if process.poll() is not None or time.monotonic() > deadline:
                    logs = run_dir(config) / "logs"
                    raise RuntimeError(f"tito up did not come up (logs in {logs}):\n" + log_path.read_text()[-3000:])
                time.sleep(0.5)
            yield process
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            process.wait(120)
