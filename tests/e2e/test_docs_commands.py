"""Every command the README and the getting-started page mark runnable (`<!-- runnable -->`
above a bash block) runs against the local stack and answers: a newcomer who pastes them
gets answers, not errors. The blocks name the stack as `localhost:8080`, `make up`'s address;
here they run against the session's `tito up` stack."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import RunningStack

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", "docs/getting-started.md"]
RUNNABLE = re.compile(r"<!-- runnable -->\n```bash\n(.*?)```", re.S)


def runnable_blocks(page: str) -> list[str]:
    return RUNNABLE.findall((ROOT / page).read_text())


@pytest.mark.parametrize("page", PAGES)
def test_the_pages_runnable_commands_answer_on_the_local_stack(page: str, stack: RunningStack) -> None:
    blocks = runnable_blocks(page)
    assert blocks, f"{page} marks no runnable block"
    address = stack.base_url.removeprefix("http://")
    for block in blocks:
        # as pasted, except that an HTTP error fails the command instead of printing a body
        script = block.replace("localhost:8080", address).replace("curl ", "curl --fail-with-body ")
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{page}:\n{block}\nstdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-2000:]}"
        assert '"error"' not in done.stdout and ('"choices"' in done.stdout or "data: " in done.stdout), done.stdout


def test_the_marker_finds_blocks_and_a_failing_command_fails(stack: RunningStack) -> None:
    """The checker itself: a marked block is found, and a command that gets an error fails."""
    page = "<!-- runnable -->\n```bash\ncurl -s localhost:8080/v1/chat/completions -d '{}'\n```\n"
    (block,) = RUNNABLE.findall(page)
    script = block.replace("localhost:8080", stack.base_url.removeprefix("http://"))
    script = script.replace("curl ", "curl --fail-with-body ")
    assert subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, timeout=60).returncode != 0
