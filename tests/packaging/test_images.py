"""Deployment artifacts, without Docker: every command the compose file and the Kubernetes
manifests run in the `tito` image runs in a fresh virtual environment built the way the
Dockerfile builds the image (its COPY lines, its RUN lines, its ENV), and a lean
`pip install tito` does what it promises (and names the extra for what it does not).

The Dockerfile, docker-compose.yml and deploy/kubernetes are parsed here, so a change to any
of them is what gets tested. Each environment is built once per run (a few minutes: vLLM's
CPU build and its dependencies; the two side by side)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from ext_proc.config import Endpoint, InstanceConfig, TitoConfig, load_config
from ext_proc.config_discovery import DiscoveryConfig
from ext_proc.envoy_protocol.bootstrap import write_bootstrap
from ext_proc.tools.tiny_model import ensure_tiny_model
from tests.conftest import free_port, missing, port_open
from tests.engine_sim import NATIVE_TEXT, EngineSim, SimServer

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "tito:latest"
# Base images this tier can stand in for: the interpreter a fresh venv is made from.
BASES = {"python:3.11-slim": "python3.11"}


@dataclass
class Dockerfile:
    base: str = ""
    workdir: str = "/"
    copies: list[tuple[list[str], str]] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    entrypoint: list[str] = field(default_factory=list)


def parse_dockerfile(text: str) -> Dockerfile:
    """The instructions this image uses (FROM, WORKDIR, COPY, RUN, ENV, ENTRYPOINT); any
    other instruction fails the test: this tier would not know how to stand in for it."""
    image = Dockerfile()
    for line in (entry.strip() for entry in text.replace("\\\n", " ").splitlines()):
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        match instruction.upper():
            case "FROM":
                image.base = rest.split()[0]
            case "WORKDIR":
                image.workdir = rest.strip()
            case "COPY":
                *sources, target = shlex.split(rest)
                image.copies.append((sources, target))
            case "RUN":
                image.runs.append(rest.strip())
            case "ENV":
                key, _, value = rest.strip().partition("=")
                image.env[key] = value
            case "ENTRYPOINT":
                image.entrypoint = yaml.safe_load(rest)
            case "CMD":
                pass  # every deployment names its command
            case _:
                pytest.fail(f"Dockerfile instruction {instruction} has no stand-in in tests/packaging")
    return image


@dataclass
class Environment:
    """A fresh venv with the package installed one way, and how to run its commands."""

    venv: Path
    app: Path
    env: dict[str, str]
    entrypoint: list[str]

    def run(self, args: list[str], timeout: float = 300, **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.entrypoint, *args], cwd=self.app, env=self.env, capture_output=True, text=True, timeout=timeout, **kw
        )

    def start(self, args: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:
            return subprocess.Popen(
                [*self.entrypoint, *args], cwd=self.app, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )


def _fresh_venv(where: Path, python: str) -> dict[str, str]:
    interpreter = shutil.which(python)
    if interpreter is None:
        missing(f"{python} (to build the image's environment)")
    subprocess.run([str(interpreter), "-m", "venv", str(where)], check=True, timeout=120)
    path = f"{where / 'bin'}{os.pathsep}{os.environ['PATH']}"
    # Nothing of this checkout or the test's own venv may leak in.
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    return {**env, "PATH": path, "VIRTUAL_ENV": str(where)}


def build_image(where: Path) -> Environment:
    """The image as an environment: a venv for the base, the COPY lines into the WORKDIR,
    the RUN lines there with the venv's python and pip first on PATH."""
    image = parse_dockerfile((ROOT / "Dockerfile").read_text())
    if image.base not in BASES:
        pytest.fail(f"no stand-in for base image {image.base}: add it to tests/packaging BASES")
    env = _fresh_venv(where / "venv", BASES[image.base])
    app = where / image.workdir.lstrip("/")
    app.mkdir(parents=True, exist_ok=True)
    for sources, target in image.copies:
        for source in sources:
            _copy(ROOT / source, app / target if target != "./" else app / Path(source).name)
    env |= image.env
    for command in image.runs:
        result = subprocess.run(["bash", "-c", command], cwd=app, env=env, capture_output=True, text=True, timeout=1800)
        assert result.returncode == 0, f"RUN {command}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    entrypoint = [str(where / "venv" / "bin" / image.entrypoint[0]), *image.entrypoint[1:]]
    return Environment(where / "venv", app, env, entrypoint)


def _copy(source: Path, target: Path) -> None:
    """What a build context holds: the checkout's files, never its generated stubs or caches."""
    if source.is_dir():
        ignore = shutil.ignore_patterns("__pycache__", "generated", "*.egg-info")
        shutil.copytree(source, target, ignore=ignore, dirs_exist_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


@pytest.fixture(scope="module")
def installs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Environment]]]:
    """The image and the lean install, built side by side: each is a pip install that keeps
    one core busy for minutes (3.5 and 1), and the machine has two."""
    with ThreadPoolExecutor(2, thread_name_prefix="install") as pool:
        yield {
            "image": pool.submit(build_image, tmp_path_factory.mktemp("image")),
            "lean": pool.submit(build_lean, tmp_path_factory.mktemp("lean")),
        }


@pytest.fixture(scope="module")
def image(installs: dict[str, Future[Environment]]) -> Environment:
    return installs["image"].result()


@pytest.fixture(scope="module")
def lean(installs: dict[str, Future[Environment]]) -> Environment:
    return installs["lean"].result()


def build_lean(where: Path) -> Environment:
    """`pip install tito`: the package from a copy of this checkout, no extras."""
    env = _fresh_venv(where / "venv", "python3.11")
    source = where / "src"
    for name in ("pyproject.toml", "README.md", "ext_proc", "scheduler", "render_sidecar", "protos", "envoy"):
        _copy(ROOT / name, source / name)
    pip = [str(where / "venv" / "bin" / "python"), "-m", "pip", "install", "-q", str(source)]
    result = subprocess.run(pip, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    return Environment(where / "venv", where, env, [str(where / "venv" / "bin" / "tito")])


# -- the commands the deployments run ------------------------------------------------------


@dataclass(frozen=True)
class Deployed:
    """One command a deployment runs in the tito image, with the config it mounts."""

    where: str
    args: tuple[str, ...]
    config: TitoConfig


def deployed_commands() -> list[Deployed]:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    compose_config = load_config(ROOT / "tito.compose.yaml", env={})
    found = [
        Deployed(f"compose {name}", tuple(service["command"]), compose_config)
        for name, service in compose["services"].items()
        if service.get("image") == IMAGE
    ]
    for path in sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml")):
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
        maps = [d for d in documents if d.get("kind") == "ConfigMap"]
        for document in documents:
            pod = (document.get("spec") or {}).get("template", {}).get("spec", {})
            for container in [*pod.get("initContainers", []), *pod.get("containers", [])]:
                if container["image"] == IMAGE:
                    config = _configmap_config(maps or _all_configmaps())
                    found.append(Deployed(f"{path.name} {container['name']}", tuple(container["args"]), config))
    return found


def _all_configmaps() -> list[dict[str, Any]]:
    return [
        d
        for path in (ROOT / "deploy" / "kubernetes").glob("*.yaml")
        for d in yaml.safe_load_all(path.read_text())
        if d and d.get("kind") == "ConfigMap"
    ]


def _configmap_config(maps: list[dict[str, Any]]) -> TitoConfig:
    [config_map] = maps
    return TitoConfig.model_validate(yaml.safe_load(config_map["data"]["tito.yaml"]))


def test_the_deployments_run_only_these_commands_in_the_image() -> None:
    """What the tests below run is everything the deployments run (a new command fails here)."""
    assert {_command(d.args) for d in deployed_commands()} == {"tiny-model", "envoy-config", "processor"}


def _on_local_ports(config: TitoConfig, model: Path, render_port: int) -> TitoConfig:
    """A deployment's config on this machine: the processor on free local ports, the model
    it mounts at /models, render where nothing listens (so render is down: the fallback)."""
    config = config.model_copy(deep=True)
    config.processor.host = config.processor.listen_host = "127.0.0.1"
    config.processor.port, config.processor.admin_port = free_port(), free_port()
    config.render_config.endpoint = Endpoint(port=render_port)
    config.model.path = str(model)
    for base in config.models:  # further base models: their tiny models generated here, render down too
        vocab = int(str(base.model.path).rsplit("-vocab", 1)[1])
        base.model.path = str(ensure_tiny_model(model.parent, vocab))
        base.render_config.endpoint = Endpoint(port=free_port())
    return config


def _localized(args: tuple[str, ...], tmp: Path, config: TitoConfig) -> list[str]:
    """The command with the container's paths made local (`config` written where it mounts its
    own; the engines' endpoints file in `tmp`, not the pod's shared volume)."""
    listener = config.listener.model_copy(update={"engine_endpoints_file": str(tmp / "run" / "engines.eds.json")})
    (tmp / "tito.yaml").write_text(config.model_copy(update={"listener": listener}).to_yaml())
    paths = {
        "/etc/tito/tito.yaml": tmp / "tito.yaml",
        "/models": tmp / "models",
        "/etc/envoy/envoy.yaml": tmp / "envoy.yaml",
    }
    return [str(paths.get(arg, arg)) for arg in args]


@pytest.mark.parametrize("deployed", deployed_commands(), ids=lambda d: d.where)
def test_each_deployed_command_runs_in_the_image(
    image: Environment, deployed: Deployed, tmp_path: Path, envoy_bin: Path
) -> None:
    model = ensure_tiny_model(Path("~/.cache/tito").expanduser())
    config = _on_local_ports(deployed.config, model, free_port())
    command = _command(deployed.args)
    if command == "tiny-model":  # the model job: torch and transformers in the image
        result = image.run(_localized(deployed.args, tmp_path, config))
        assert result.returncode == 0, result.stderr[-3000:]
        printed = result.stdout.split()  # one path per --vocab-size
        assert printed and all((Path(path) / ".complete").exists() for path in printed)
    elif command == "envoy-config":  # the bootstrap the deployment's Envoy loads, from its config as mounted
        result = image.run(_localized(deployed.args, tmp_path, deployed.config))
        assert result.returncode == 0, result.stderr[-3000:]
        _assert_envoy_accepts(envoy_bin, tmp_path / "envoy.yaml")
    else:  # the processor starts to its ports (vLLM's tokenizer and parsers in the image) and stops cleanly
        process = image.start(_localized(deployed.args, tmp_path, config), tmp_path / "processor.log")
        try:
            _wait(lambda: port_open(config.processor.admin_port) or process.poll() is not None, 180)
            assert process.poll() is None, (tmp_path / "processor.log").read_text()[-3000:]
            assert port_open(config.processor.port)
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(30) == 0


def _assert_envoy_accepts(envoy_bin: Path, bootstrap: Path) -> None:
    validated = subprocess.run(
        [str(envoy_bin), "--mode", "validate", "-c", str(bootstrap), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert validated.returncode == 0, validated.stdout + validated.stderr


def _command(args: tuple[str, ...]) -> str:
    return args[args.index("--config") + 2] if "--config" in args else args[0]


def _wait(done: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.2)


# -- the fallback in the image ------------------------------------------------------------------


@pytest.fixture
def image_gateway(image: Environment, tmp_path: Path, envoy_bin: Path) -> Iterator[tuple[TitoConfig, EngineSim]]:
    """Envoy + the image's processor over an engine simulator, render down."""
    server = SimServer(EngineSim()).start()
    model = ensure_tiny_model(Path("~/.cache/tito").expanduser())
    [deployed] = [d for d in deployed_commands() if d.where == "compose processor"]
    config = _on_local_ports(deployed.config, model, free_port())
    config.listener.host, config.listener.admin_host = "127.0.0.1", "127.0.0.1"
    config.listener.port, config.listener.admin_port = free_port(), free_port()
    config.listener.engine_endpoints_file = str(tmp_path / "run" / "engines.eds.json")  # (as _localized has it)
    # the compose pool is discovered through Docker's DNS: here, the simulator listed instead
    engine = InstanceConfig(host="127.0.0.1", port=server.sim.port)
    config.pools[0] = config.pools[0].model_copy(update={"instances": [engine], "discovery": DiscoveryConfig()})
    processor = image.start(_localized(deployed.args, tmp_path, config), tmp_path / "processor.log")
    envoy = subprocess.Popen(
        [
            str(envoy_bin),
            "-c",
            str(write_bootstrap(config, tmp_path / "envoy.yaml")),
            "--disable-hot-restart",
            "-l",
            "warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait(lambda: port_open(config.processor.port) and port_open(config.listener.port), 180)
        assert processor.poll() is None, (tmp_path / "processor.log").read_text()[-3000:]
        yield config, server.sim
    finally:
        envoy.terminate()
        processor.send_signal(signal.SIGTERM)
        envoy.wait(15)
        processor.wait(30)
        server.stop()


def test_the_image_processor_serves_through_the_fallback_tokenizer_with_render_down(
    image_gateway: tuple[TitoConfig, EngineSim],
) -> None:
    config, sim = image_gateway
    body = {"model": config.model.served_name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    response = httpx.post(
        f"http://127.0.0.1:{config.listener.port}/v1/chat/completions", json=body, timeout=120, trust_env=False
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == NATIVE_TEXT
    state = httpx.get(f"http://127.0.0.1:{config.processor.admin_port}/debug/state", timeout=5, trust_env=False).json()
    # transformers in the image: the engines' tokenizer and chat template, loaded on the failure
    assert state["tokenization"]["local_tokenizer_loaded"] is True
    assert state["tokenization"]["fallbacks"] == {"unavailable": 1}


# -- the lean install -----------------------------------------------------------------------------


def test_a_lean_install_runs_the_cli_and_envoy_config(lean: Environment, tmp_path: Path, envoy_bin: Path) -> None:
    assert lean.run(["--help"]).returncode == 0
    result = lean.run(["envoy-config", "--out", str(tmp_path / "envoy.yaml")])
    assert result.returncode == 0, result.stderr
    _assert_envoy_accepts(envoy_bin, tmp_path / "envoy.yaml")


@pytest.mark.parametrize(
    ("args", "extra"),
    [
        (["processor"], "processor"),
        (["tiny-model", "--cache-dir", "{tmp}"], "processor"),
        (["render"], "processor"),
        (["vllm", "serve", "--help"], "processor"),
        (["up"], "engine"),
    ],
    ids=["processor", "tiny-model", "render", "vllm", "up"],
)
def test_a_lean_install_names_the_extra_a_command_needs(
    lean: Environment, tmp_path: Path, args: list[str], extra: str
) -> None:
    config = tmp_path / "tito.yaml"
    config.write_text(f"processor: {{port: {free_port()}, admin_port: {free_port()}}}\nmodel: {{path: {tmp_path}}}\n")
    result = lean.run(["--config", str(config), *[a.format(tmp=tmp_path) for a in args]], timeout=120)
    assert result.returncode == 2
    assert f"pip install 'tito[{extra}]'" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
