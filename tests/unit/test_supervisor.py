"""`tito up` supervises render processes and engines: the restart policy (ext_proc/tools/supervisor.py)
on a clock of the test's own, the supervising loop over stand-in processes, and a restart that leaves
no process of the old group behind (tiny `python -c` processes, no engines)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ext_proc.config import TitoConfig
from ext_proc.tools.local_stack import LocalStack, Supervision
from ext_proc.tools.managed_process import ManagedProcess, group_running
from ext_proc.tools.supervisor import Backoff, Restart, RestartPolicy, exit_status, restart_line

RESTARTABLE = ["render", "render-1", "engine0", "engine1"]


def _policy() -> RestartPolicy:
    policy = RestartPolicy(RESTARTABLE, Backoff(initial_s=1, max_s=30, stable_s=60))
    for name in RESTARTABLE:
        policy.started(name, 0.0)
    return policy


def _crash_loop(policy: RestartPolicy, name: str, now: float, times: int) -> list[Restart]:
    """`name` exits `times` times, each right after its restart was due and done."""
    restarts = []
    for _ in range(times):
        restart = policy.exited(name, now)
        restarts.append(restart)
        now = restart.due
        policy.started(name, now)
    return restarts


def test_the_delay_doubles_from_1_s_to_at_most_30_s() -> None:
    restarts = _crash_loop(_policy(), "engine0", 1.0, 8)
    assert [r.attempt for r in restarts] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [r.delay_s for r in restarts] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert restarts[0].due == 2.0  # exited at 1.0, one second later


def test_a_process_that_stayed_up_starts_from_the_short_delay_again() -> None:
    policy = _policy()
    last = _crash_loop(policy, "engine0", 1.0, 5)[-1]  # attempt 5 (16 s); restarted at last.due
    assert policy.exited("engine0", last.due + 59.9).attempt == 6  # not stable yet: backoff goes on
    policy.started("engine0", 1000.0)
    again = policy.exited("engine0", 1060.0)  # up 60 s: a new failure, not the same crash loop
    assert (again.attempt, again.delay_s) == (1, 1)


def test_each_process_backs_off_on_its_own() -> None:
    policy = _policy()
    _crash_loop(policy, "engine0", 1.0, 4)
    assert policy.exited("engine1", 1.0).delay_s == 1


def test_a_restart_is_due_only_once_its_delay_has_passed() -> None:
    policy = _policy()
    assert not policy.waiting("render")
    restart = policy.exited("render", 10.0)
    assert policy.waiting("render")  # found dead again meanwhile: not scheduled a second time
    assert policy.due(restart.due - 0.01) == []
    assert policy.due(restart.due) == ["render"]
    policy.started("render", restart.due)
    assert policy.due(restart.due + 100) == [] and not policy.waiting("render")


def test_render_processes_and_engines_are_restarted_the_processor_and_envoy_are_not(tmp_path: Path) -> None:
    config = TitoConfig.model_validate(
        {
            "model": {"path": str(tmp_path)},  # a path: no tiny model is generated
            "render_config": {"replicas": 2},
            "pools": [{"instances": [{"port": 8200}, {"port": 8201}]}],
        }
    )
    stack = LocalStack(config, tmp_path / "run")
    assert stack.restartable() == set(RESTARTABLE)
    policy = RestartPolicy(stack.restartable())
    assert not policy.restartable("processor") and not policy.restartable("envoy")
    with pytest.raises(ValueError):
        policy.exited("processor", 0.0)


def test_the_processor_or_envoy_exiting_ends_the_stack_engines_alone_never_do() -> None:
    policy = _policy()
    assert policy.ends_stack(["processor"])
    assert policy.ends_stack(["envoy"])
    assert policy.ends_stack(["engine0", "envoy"])
    assert not policy.ends_stack(["engine0", "engine1"])  # every engine down: they come back
    assert not policy.ends_stack(RESTARTABLE)
    assert not policy.ends_stack([])


def test_an_engine_added_while_the_stack_runs_is_restarted_and_never_ends_the_stack() -> None:
    policy = _policy()
    assert not policy.restartable("engine2") and policy.ends_stack(["engine2"])
    policy.add("engine2", 100.0)  # `tito scale` started it
    assert policy.restartable("engine2") and not policy.ends_stack(["engine2"])
    assert not policy.ends_stack(["engine0", "engine2"])
    restart = policy.exited("engine2", 101.0)  # crashed soon after its start: backs off as the others do
    assert (restart.attempt, restart.delay_s, restart.due) == (1, 1, 102.0)
    assert policy.waiting("engine2") and policy.due(102.0) == ["engine2"]
    policy.started("engine2", 102.0)
    assert policy.exited("engine2", 103.0).attempt == 2  # its history is its own: the crash loop counts


def test_an_engine_removed_on_purpose_is_not_restarted() -> None:
    policy = _policy()
    policy.add("engine2", 0.0)
    policy.exited("engine2", 10.0)  # its restart was waiting when `tito scale` stopped it
    policy.remove("engine2")
    assert not policy.restartable("engine2") and not policy.waiting("engine2")
    assert policy.due(1000.0) == []  # the waiting restart is dropped with it
    with pytest.raises(ValueError):
        policy.exited("engine2", 20.0)
    assert policy.restartable("engine0") and not policy.ends_stack(["engine0"])  # the others keep theirs
    policy.add("engine2", 30.0)  # scaled up again later: restartable anew, from attempt 1
    assert policy.exited("engine2", 31.0).attempt == 1


def test_an_engine_removed_on_purpose_does_not_end_the_stack_when_found_exited() -> None:
    """`remove`'s contract: "neither restarted nor fatal" (a stopped engine is found exited)."""
    policy = _policy()
    policy.add("engine2", 0.0)
    policy.remove("engine2")
    assert not policy.ends_stack(["engine2"])


def test_the_restart_line_names_the_process_its_exit_the_attempt_the_delay_and_the_log() -> None:
    line = restart_line(Restart("engine0", 3, 4.0, 12.0), -9, Path("/run/logs/engine0.log"))
    assert line == "engine0 exited with signal SIGKILL; restart 3 in 4 s (log: /run/logs/engine0.log)"
    assert exit_status(1) == "code 1"
    assert exit_status(None) == "no exit code (it did not start)"


@dataclass
class _Stub:
    """What the supervising loop reads of a ManagedProcess."""

    log_path: Path
    returncode: int | None = None

    def alive(self) -> bool:
        return self.returncode is None


class _Stack:
    """A LocalStack's processes as stubs: `restart` brings one back alive."""

    def __init__(self, names: list[str], work_dir: Path) -> None:
        self.work_dir = work_dir
        self.processes = {name: _Stub(work_dir / "logs" / f"{name}.log") for name in names}
        self.restarts: list[str] = []
        self.config = TitoConfig.model_validate({"local": {"colocate_engine_core": False}})
        self.scale_up: list[str] = []
        self.scale_down: list[str] = []
        self.ready: set[str] = set()  # engines whose /health answers
        self.shares: list[tuple[str, bool]] = []  # yield_cpu calls

    def engine_ready(self, name: str) -> bool:
        return name in self.ready

    def yield_cpu(self, name: str, yielding: bool) -> bool:
        self.shares.append((name, yielding))
        return True

    def restartable(self) -> set[str]:
        return {name for name in self.processes if name.startswith(("render", "engine"))}

    def engines(self) -> list[tuple[str, None, None]]:
        return [(name, None, None) for name in self.processes if name.startswith("engine")]

    def restart(self, name: str) -> None:
        self.restarts.append(name)
        self.processes[name].returncode = None

    def scale(self, policy: RestartPolicy, now: float) -> list[str]:
        """`tito scale` steps, as LocalStack takes them: `scale_up` names start (and are
        restarted from then on), `scale_down` names are stopped on purpose and forgotten."""
        started = []
        while self.scale_up:
            name = self.scale_up.pop(0)
            self.processes[name] = _Stub(self.work_dir / "logs" / f"{name}.log")
            policy.add(name, now)
            started.append(name)
        while self.scale_down:
            name = self.scale_down.pop(0)
            policy.remove(name)
            self.processes.pop(name).returncode = -15
        return started


def _supervision(tmp_path: Path) -> tuple[_Stack, Supervision]:
    stack = _Stack(["render", "engine0", "engine1", "processor", "envoy"], tmp_path)
    supervision = Supervision(stack, Backoff(initial_s=1, max_s=30, stable_s=60))  # type: ignore[arg-type]
    for name in stack.restartable():
        supervision.policy.started(name, 0.0)
    return stack, supervision


def test_the_loop_restarts_every_engine_after_its_delay_and_keeps_the_stack_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stack, supervision = _supervision(tmp_path)
    stack.processes["engine0"].returncode = -9
    stack.processes["engine1"].returncode = 1
    assert supervision.step(10.0)  # every engine down: the stack stays up
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"engine0 exited with signal SIGKILL; restart 1 in 1 s (log: {tmp_path / 'logs' / 'engine0.log'})",
        f"engine1 exited with code 1; restart 1 in 1 s (log: {tmp_path / 'logs' / 'engine1.log'})",
    ]
    assert supervision.step(10.5) and stack.restarts == []  # found dead again: no second line, no restart yet
    assert capsys.readouterr().err == ""
    assert supervision.step(11.0) and stack.restarts == ["engine0", "engine1"]
    stack.processes["engine0"].returncode = -9  # dies again at once: 2 s this time
    assert supervision.step(11.5)
    assert "restart 2 in 2 s" in capsys.readouterr().err


def test_the_loop_ends_the_stack_when_the_processor_or_envoy_exits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("processor", "envoy"):
        stack, supervision = _supervision(tmp_path)
        stack.processes[name].returncode = 1
        assert not supervision.step(5.0)
        assert stack.restarts == []
        assert capsys.readouterr().err.startswith(f"stopping: {name} (code 1) exited")


def test_the_loop_restarts_an_engine_scaled_up_and_forgets_one_scaled_down(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stack, supervision = _supervision(tmp_path)
    stack.scale_up.append("engine2")
    assert supervision.step(1.0) and "engine2" in stack.processes
    stack.processes["engine2"].returncode = 1  # crashes: restarted as the configured engines are
    assert supervision.step(2.0) and "engine2 exited with code 1; restart 1 in 1 s" in capsys.readouterr().err
    assert supervision.step(3.0) and stack.restarts == ["engine2"]
    stack.scale_down.append("engine2")
    assert supervision.step(4.0) and "engine2" not in stack.processes
    stack.processes["engine1"].returncode = 1
    assert supervision.step(5.0)  # the stack goes on; the stopped engine is not restarted
    assert supervision.step(100.0) and stack.restarts == ["engine2", "engine1"]


def test_serving_engines_yield_their_cpu_share_while_another_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stack, supervision = _supervision(tmp_path)
    stack.processes["engine1"].returncode = -9
    assert supervision.step(1.0) and stack.shares == []  # nothing starts yet
    assert supervision.step(2.0) and stack.restarts == ["engine1"]
    assert stack.shares == [("engine0", True)]
    assert "engine0: CPU share yielded while engine1 starts" in capsys.readouterr().err
    stack.scale_up.append("engine2")  # a second one starts meanwhile: engine0 already yields
    assert supervision.step(3.0) and stack.shares == [("engine0", True)]
    stack.ready.add("engine1")  # engine1 up: it yields to engine2 too
    assert supervision.step(4.0) and stack.shares[1:] == [("engine1", True)]
    stack.ready.add("engine2")
    assert supervision.step(5.0) and stack.shares[2:] == [("engine0", False), ("engine1", False)]
    assert "engine0, engine1: full CPU share again" in capsys.readouterr().err
    assert supervision.step(6.0) and len(stack.shares) == 4  # nothing starts: nothing changes


def test_no_engine_yields_when_so_configured(tmp_path: Path) -> None:
    stack, supervision = _supervision(tmp_path)
    stack.config = TitoConfig.model_validate(
        {"local": {"colocate_engine_core": False, "yield_to_starting_engines": False}}
    )
    stack.processes["engine1"].returncode = -9
    assert supervision.step(1.0) and supervision.step(2.0) and stack.restarts == ["engine1"]
    assert stack.shares == []


# A leader that starts a child in its own process group (as vLLM's API server starts its
# EngineCore), says so, and exits: the child lingers, as a killed engine's children can.
LEADER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
"""


def test_a_restart_leaves_no_process_of_the_old_group_behind(tmp_path: Path) -> None:
    process = ManagedProcess("engine0", [sys.executable, "-c", LEADER], tmp_path / "engine0.log")
    process.start()
    assert process.popen is not None
    process.popen.wait(10)
    child = int(process.log_path.read_text().split()[0])
    try:
        assert group_running(process.popen.pid)  # the leader is gone, its child is not
        process.stop()
        assert process.wait_group_gone(timeout=10)
        assert not group_running(process.popen.pid)
    finally:
        if group_running(process.popen.pid):
            os.kill(child, signal.SIGKILL)


def test_an_engine_shares_the_stacks_session_in_a_process_group_of_its_own(tmp_path: Path) -> None:
    """Engines run in one session, so the scheduler weighs their tasks as tasks, not as one
    group per engine (managed_process.py); stopping one still reaches its children."""
    process = ManagedProcess("engine0", [sys.executable, "-c", LEADER], tmp_path / "e.log", own_session=False)
    process.start()
    assert process.popen is not None
    process.popen.wait(10)
    child = int(process.log_path.read_text().split()[0])
    try:
        assert os.getsid(child) == os.getsid(0)  # the stack's session
        assert os.getpgid(child) == process.popen.pid != os.getpgid(0)  # the engine's own group
        process.stop()
        assert process.wait_group_gone(timeout=10)
    finally:
        if group_running(process.popen.pid):
            os.kill(child, signal.SIGKILL)


def test_restart_stops_the_old_group_then_starts_the_same_process_in_its_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = TitoConfig.model_validate({"model": {"path": str(tmp_path)}})
    stack = LocalStack(config, tmp_path / "run")
    calls: list[tuple[str, list[str]]] = []
    stop, gone = ManagedProcess.stop, ManagedProcess.wait_group_gone

    def recorded_stop(self: ManagedProcess) -> None:
        calls.append(("stop", self.command))
        stop(self)

    def recorded_gone(self: ManagedProcess) -> bool:
        calls.append(("gone", self.command))
        return gone(self)

    monkeypatch.setattr(ManagedProcess, "start", lambda self: calls.append(("start", self.command)))
    monkeypatch.setattr(ManagedProcess, "stop", recorded_stop)
    monkeypatch.setattr(ManagedProcess, "wait_group_gone", recorded_gone)
    stack.start_backends()
    stack.processes["processor"] = ManagedProcess("processor", ["true"], tmp_path / "p.log")
    old = stack.processes["engine0"]
    old.popen = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    old.popen.wait(10)
    calls.clear()
    stack.restart("engine0")
    assert stack.processes["engine0"] is not old
    # the old group stopped and gone before the new one starts, on the same port and flags
    assert calls == [("stop", old.command), ("gone", old.command), ("start", old.command)]
    assert list(stack.processes) == ["render", "engine0", "processor"]  # stop() still goes in reverse
