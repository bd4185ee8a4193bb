"""The `tito` command line: one parser listing every command, the global options on either
side of the command, `tito render` deriving the render sidecar's flags from the config, and
`tito vllm` running vLLM's own CLI in this install (whose `vllm` command crashes)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ext_proc import cli
from ext_proc.config import load_config
from render_sidecar import launch
from tests.conftest import missing

ROOT = Path(__file__).resolve().parents[2]
EVERY_COMMAND = {
    "up",
    "scale",
    "processor",
    "render",
    "vllm",
    "envoy-config",
    "tiny-model",
    "engines",
    "conformance",
    "epp-check",
    "hash-key",
    "bench",
    "config-reference",
}
# Each command with the arguments it requires, to parse it with the global options around.
REQUIRED = {
    "bench": ["--gateway", "http://g", "--native", "http://n"],
    "scale": ["2"],
    "conformance": ["--gateway", "http://g", "--native", "http://n", "--model", "m"],
    "epp-check": ["--epp", "h:1", "--model", "m"],
}


def _tito(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}  # one line per command in the help
    return subprocess.run(
        [sys.executable, "-m", "ext_proc.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_tito_help_lists_every_command_with_its_help() -> None:
    result = _tito("--help")
    assert result.returncode == 0, result.stderr
    listed = dict(re.findall(r"^ {4}(\S+) +(\S.*)$", result.stdout, re.MULTILINE))
    assert set(listed) == EVERY_COMMAND == set(cli.COMMANDS)
    assert all(listed[name] == command.help for name, command in cli.COMMANDS.items())


def test_tito_help_imports_no_tool_and_neither_vllm_nor_torch() -> None:
    probe = (
        "import contextlib, sys\n"
        "from ext_proc import cli\n"
        "with contextlib.redirect_stdout(None), contextlib.suppress(SystemExit):\n"
        "    cli.main(['--help'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'vllm', 'torch', 'transformers'}"
        " or m.startswith('ext_proc.tools.') and m != 'ext_proc.tools.tiny_model'))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("command", sorted(EVERY_COMMAND - {"vllm"}))
def test_global_options_parse_alike_before_and_after_the_command(command: str) -> None:
    own = REQUIRED.get(command, [])
    options = ["--config", "tito.yaml", "--log-level", "DEBUG"]
    before = cli.build_parser().parse_args([*options, command, *own])
    after = cli.build_parser().parse_args([command, *own, *options])
    assert (before.command, before.config, before.log_level) == (command, "tito.yaml", "DEBUG")
    assert vars(before) == vars(after)
    # after the command wins; absent after it, the value before it stays
    both = cli.build_parser().parse_args(["--config", "a.yaml", command, *own, "--config", "b.yaml"])
    assert (both.config, both.log_level) == ("b.yaml", "INFO")
    only_before = cli.build_parser().parse_args(["--log-level", "ERROR", command, *own])
    assert (only_before.config, only_before.log_level) == (None, "ERROR")


def test_tito_vllm_hands_every_argument_to_vllm_untouched() -> None:
    argv = ["serve", "/models/m", "--config", "vllm.yaml", "--log-level", "x", "--help", "--", "-x"]
    args = cli.build_parser().parse_args(["--config", "tito.yaml", "vllm", *argv])
    assert (args.command, args.argv, args.config) == ("vllm", argv, "tito.yaml")
    assert cli.build_parser().parse_args(["vllm", "--version"]).argv == ["--version"]


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "tito.yaml"
    path.write_text(
        """
model:
  path: /models/my-model
  served_name: my-model
  aliases: [my-alias, other-alias]
  max_model_len: 4096
  chat_template: /templates/chat.jinja
  reasoning_parser: qwen3
  tool_call_parser: hermes
  enable_auto_tool_choice: true
render_config:
  endpoints: [{host: 127.0.0.1, port: 8100}, {host: 127.0.0.2, port: 8201}]
  renderer_num_workers: 2
"""
    )
    return path


def _printed_render(capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    assert cli.main(["render", "--print", *args]) == 0
    return shlex.split(capsys.readouterr().out)


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def _contains(command: list[str], part: list[str]) -> bool:
    return any(command[i : i + len(part)] == part for i in range(len(command)))


def test_tito_render_runs_vllms_render_server_with_the_configs_model_flags(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = load_config(config_file)
    command = _printed_render(capsys, "--config", str(config_file))
    assert command[: len(launch.vllm_cli()) + 2] == [*launch.vllm_cli(), "launch", "render"]
    flags = launch.model_flags(config.model, "/models/my-model")
    assert _contains(command, flags), command
    for flag in (
        ["--model", "/models/my-model"],
        ["--served-model-name", "my-model", "my-alias", "other-alias"],
        ["--max-model-len", "4096"],
        ["--chat-template", "/templates/chat.jinja"],
        ["--reasoning-parser", "qwen3"],
        ["--tool-call-parser", "hermes"],
        ["--enable-auto-tool-choice"],
    ):
        assert _contains(command, flag), flag
    assert (_flag(command, "--host"), _flag(command, "--port")) == ("127.0.0.1", "8100")
    assert _flag(command, "--renderer-num-workers") == "2"
    assert "--disable-uvicorn-access-log" in command  # (the processor logs every request)
    logged = config.render_config.model_copy(update={"access_log": True})
    assert "--disable-uvicorn-access-log" not in launch.render_command(logged, config.model, "/m")


def test_tito_render_endpoint_picks_the_render_pools_nth(config_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    command = _printed_render(capsys, "--endpoint", "1", "--config", str(config_file))
    assert (_flag(command, "--host"), _flag(command, "--port")) == ("127.0.0.2", "8201")
    assert cli.main(["--config", str(config_file), "render", "--print", "--endpoint", "2"]) == 2
    assert "endpoints are 0 to 1" in capsys.readouterr().err


def test_vllm_commands_go_through_tito_vllm_without_the_vllm_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config(env={})
    monkeypatch.setattr(launch, "has_vllm_cli", lambda: False)
    tito_vllm = [sys.executable, "-m", "ext_proc.cli", "vllm"]
    render = launch.render_command(config.render_config, config.model, "/m")
    assert render[:6] == [*tito_vllm, "launch", "render"]
    engine = launch.engine_command(config.model, "/m", "127.0.0.1", 8200)
    assert engine[:5] == [*tito_vllm, "serve"] and _flag(engine, "--model") == "/m"
    assert "--dtype" not in engine  # vLLM's default, unless asked (`tito up`: float32)
    assert _flag(launch.engine_command(config.model, "/m", "127.0.0.1", 8200, dtype="float32"), "--dtype") == "float32"
    monkeypatch.setattr(launch, "has_vllm_cli", lambda: True)
    assert launch.engine_command(config.model, "/m", "127.0.0.1", 8200)[:2] == ["vllm", "serve"]


def test_tito_vllm_version_runs_vllms_own_cli() -> None:
    if importlib.util.find_spec("vllm") is None:
        missing("vLLM")
    result = _tito("vllm", "--version")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "PackageNotFoundError" not in result.stderr
    (provider, *_) = importlib.metadata.packages_distributions()["vllm"]
    assert result.stdout.strip().split("+")[0] == importlib.metadata.version(provider)
