"""The gRPC ExternalProcessor service Envoy streams every HTTP exchange through."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ext_proc.admin import start_admin, state
from ext_proc.api.conversation_store import build_conversation_store
from ext_proc.api.conversations import Conversations
from ext_proc.api.routes import client_apis, render_routes
from ext_proc.byte_budget import ByteBudget
from ext_proc.config import InstanceConfig, PoolConfig, TitoConfig
from ext_proc.derender.model import DerenderModel
from ext_proc.derender.pipeline import build_derenderer
from ext_proc.derender.sidecar import DerenderClient
from ext_proc.envoy_protocol.bootstrap import discovered
from ext_proc.envoy_protocol.endpoints import EndpointsFile
from ext_proc.envoy_protocol.exchange import Exchange
from ext_proc.envoy_protocol.h2_server import H2GrpcServer, Method, Outbox
from ext_proc.envoy_protocol.stream import PROCESS, QueuedOutbox
from ext_proc.errors import GatewayError
from ext_proc.fleet.capabilities import Capabilities
from ext_proc.fleet.http_client import CountingTransport, http_client
from ext_proc.fleet.lora import AdapterLoader
from ext_proc.fleet.membership import Membership, instance_work
from ext_proc.frontend.model_catalog import ModelCatalog
from ext_proc.frontend.render import RenderClient
from ext_proc.frontend.render_pool import RenderPool, pool_member
from ext_proc.frontend.tokenization import LocalTokenizer, TokenizationService
from ext_proc.health import HEALTH_CHECK, Health
from ext_proc.legs.trigger import Triggers
from ext_proc.loop_lag import LoopLag
from ext_proc.model_files import vocab_size
from ext_proc.obfuscation import build_codec
from ext_proc.observability.request import Observability, clock
from ext_proc.observability.stage_cpu import StageProfile, install
from ext_proc.observability.tracing import tracer_from_environment
from ext_proc.planning.plan import engine_legs
from ext_proc.planning.planner import Planner
from ext_proc.services import ProcessState, Services
from ext_proc.tenancy.flows import Tenancy
from ext_proc.tenancy.quota import TokenQuota
from protos.stubs import ext_proc_grpc, ext_proc_pb
from scheduler import (
    AffinityWeights,
    BreakerConfig,
    Capability,
    Instance,
    Pool,
    Role,
    Scheduler,
    TokenLedger,
    make_policy,
)
from scheduler.lora import AdapterPlacement

log = logging.getLogger("tito.ext_proc")
# A fixed receive window per stream: Envoy cannot push request bodies far ahead of what the
# processor has read and counted.
STREAM_WINDOW = 1 << 20


class ExternalProcessor(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, services: Services) -> None:
        self._services = services
        self._closing: set[asyncio.Task[None]] = set()

    def _track(self, task: asyncio.Task[None]) -> None:
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def process(self, messages: AsyncIterator[ext_proc_pb.ProcessingRequest], outbox: Outbox) -> None:
        """One ext_proc stream on the processor's own HTTP/2 server (`processor.grpc_server: h2`),
        which writes each reply as it is put, and cancels this task when the stream ends early."""
        await self._exchange(Exchange(self._services), messages, outbox)

    async def Process(  # noqa: N802 - the gRPC method name (`processor.grpc_server: grpcio`)
        self,
        request_iterator: AsyncIterator[ext_proc_pb.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        exchange = Exchange(self._services)
        # gRPC may drop this handler suspended (the RPC cancelled while a reply was being
        # sent) and never resume it: the exchange is closed when the RPC ends, whatever happens.
        loop = asyncio.get_running_loop()
        context.add_done_callback(lambda _: self._track(loop.create_task(exchange.aclose())))
        outbox = QueuedOutbox()  # grpc.aio's write is a coroutine: a task of its own writes the replies
        exchange.done.add_done_callback(lambda _: outbox.put(None))
        async with asyncio.TaskGroup() as group:  # (a failed write ends the exchange too)
            group.create_task(self._exchange(exchange, request_iterator, outbox))
            group.create_task(outbox.drain(context.write))

    async def _exchange(
        self, exchange: Exchange, messages: AsyncIterator[ext_proc_pb.ProcessingRequest], outbox: Outbox
    ) -> None:
        exchange.start(messages, outbox)
        try:
            await exchange.done
        except asyncio.CancelledError:
            # The client went away (Envoy reset the stream): a normal end.
            log.debug("stream cancelled in mode %s", exchange.mode.value)
            raise
        finally:
            await exchange.aclose()


def build_scheduler(config: TitoConfig, gated: bool = False) -> Scheduler:
    """`gated`: no engine routes before its capability record is complete."""
    s = config.scheduler
    weights = AffinityWeights(s.prefill_load_scale, s.overlap_credit, s.load_weight, s.hit_rate_threshold)
    return Scheduler(
        pools=[_pool(p) for p in config.pools],
        policy=make_policy(s.policy, weights),
        ledger=TokenLedger(*config.process_token_budgets),
        breaker=BreakerConfig(s.breaker.failure_threshold, s.breaker.base_cooldown_s, s.breaker.max_cooldown_s),
        max_fallbacks=s.max_fallbacks,
        prefix_index_max_blocks=s.prefix_index_max_blocks,
        prefix_source=s.prefix_source,
        kv_events_lag_s=s.kv_events_lag_s,
        hash_seed=s.hash_seed,
        load_source=s.load_source,
        engine_metrics_stale_s=s.engine_metrics_stale_s,
        gated=gated,
        lora=AdapterPlacement(config.lora.max_loras, config.lora.spread_requests),
    )


def _pool(config: PoolConfig) -> Pool:
    role = Role(config.role)
    # A decode instance that declares nothing does Handoff (the default P/D mode).
    default = {Capability.HANDOFF} if role is Role.DECODE else set()

    def instance(i: InstanceConfig) -> Instance:
        capabilities = frozenset(Capability(c) for c in i.capabilities) or frozenset(default)
        return Instance(i.address, config.name, role, capabilities)

    return Pool(config.name, role, tuple(instance(i) for i in config.instances), config.block_size)


async def build_render_pool(config: TitoConfig) -> RenderPool | None:
    """The configured render (None: disabled): a client per render endpoint, or vLLM's
    renderer loaded into this process now (seconds), never on a request."""
    render = config.render_config
    if not render.enable:
        return None
    cooldown = render.breaker_cooldown_s
    if render.mode == "in_process":
        from ext_proc.frontend.render_in_process import InProcessRender

        renderer = await InProcessRender.load(
            config.model, render.prefix_cache, render.prefix_cache_max_ids, render.reuse_parsers
        )
        for path, route in render_routes().items():  # what the client APIs need beyond chat and completions
            renderer.serve(path, route)
        members = [pool_member("in_process", None, renderer, cooldown, renderer.prefix_cache)]
    else:
        connections = config.processor.http_max_connections
        members = [
            pool_member(e.address, e.url, RenderClient(e.url, e.timeout_ms or render.timeout_ms, connections), cooldown)
            for e in render.pool()
        ]
    return RenderPool(members, config.model.served_name, render.p99_budget_ms)


def answering_block_size(config: TitoConfig) -> int:
    """The block size of the engines whose answers carry the usage: decode or union ones."""
    answering = [p for p in config.pools if p.role != "prefill"] or config.pools
    return answering[0].block_size if answering else PoolConfig().block_size


async def build_gateway(
    config: TitoConfig, http: httpx.AsyncClient, streams: CountingTransport, observability: Observability | None = None
) -> Services:
    """Every base model's services (the first base's, whose `bases` lists them all), sharing
    the process's HTTP client, byte budget, observability and counters."""
    first: Services | None = None
    for base in config.bases():
        services = build_services(base, http, streams, await build_render_pool(base), observability, first)
        first = first or services
    assert first is not None
    return first


def build_services(
    config: TitoConfig,
    http: httpx.AsyncClient,
    streams: CountingTransport,
    render_pool: RenderPool | None,
    observability: Observability | None = None,
    first: Services | None = None,
) -> Services:
    """One base model's services; `first`: the first base's, whose process state it shares."""
    render = config.render_config
    codec = build_codec(config)
    local = LocalTokenizer(config.model.path, config.processor.fallback_tokenizer_timeout_s)
    tokenization = TokenizationService(render_pool, local, codec, vocab_size(config.model.path))
    scheduler = build_scheduler(config, gated=config.capabilities.enable)
    catalog = ModelCatalog(config.model)  # what engines list feeds resolution and /v1/models
    planner = Planner(config, tokenization, scheduler, catalog=catalog)
    if config.lora.on_missing == "load":
        planner.load_adapter = AdapterLoader(http, scheduler, config.capabilities.timeout_s).load
    loop_lag = first.loop_lag if first is not None else LoopLag()
    planner.loop_lag_ms = loop_lag.recent_ms
    capabilities = (
        Capabilities(config, scheduler, tokenization, http, catalog=catalog) if config.capabilities.enable else None
    )
    if first is not None:
        observability = first.observability
    elif observability is None:
        collector = config.tracing.collector
        tracer = tracer_from_environment(collector.url if collector is not None else None)
        observability = Observability(tracer=tracer, stages=StageProfile() if config.processor.profile_stages else None)
    membership = Membership(config, scheduler, capabilities, instance_work(config, scheduler, http))
    planner.on_breaker = observability.breaker_changed
    planner.on_panic = observability.breaker_panic
    planner.flow.on_outcome = observability.metrics.flow_outcome
    planner.on_tenant_tokens = lambda tenant, tokens: observability.metrics.tenant_tokens.labels(tenant).inc(tokens)
    planner.quota = first.planner.quota if first is not None else token_quota(config)
    if render_pool is not None:
        render_pool.on_render = observability.render_attempt
    if capabilities is not None:
        planner.on_breaker = _both(observability.breaker_changed, capabilities.breaker_changed)
        planner.on_engine_failed = capabilities.engine_failed  # a dead engine leaves routing at once
    model = DerenderModel(config.model, answering_block_size(config))
    model.system_fingerprint = catalog.system_fingerprint  # what the engines' answers carry
    if first is not None:
        conversations = first.conversations
    else:
        conversations = Conversations(build_conversation_store(config.conversation_store))
        conversations.on_outcome = lambda op, outcome: observability.metrics.conversation_store.labels(
            op, outcome
        ).inc()
    services = Services(
        config=config,
        tokenization=tokenization,
        derender=build_derenderer(
            config, DerenderClient(render, http, config.model.served_name, config.model.has_parser), model, codec
        ),
        apis=client_apis(planner, render_pool, config.model, model, conversations),
        planner=planner,
        http=http,
        http_streams=streams,
        inflight=first.inflight if first is not None else ByteBudget(config.inflight_bytes),
        triggers=Triggers(planner, http, config.listener.stream_idle_timeout_s),
        codec=codec,
        tokenizer=model.tokenizer,
        observability=observability,
        capabilities=capabilities,
        membership=membership,
        tenancy=first.tenancy if first is not None else Tenancy(config),
        conversations=conversations,
        loop_lag=loop_lag,
        process=first.process if first is not None else ProcessState(),
    )
    planner.flow.evict = _evicting(services.process)
    if first is None:
        observability.metrics.watch(lambda: state(services))
    else:
        first.process.bases.append(services)
    return services


def _evicting(process: ProcessState) -> Callable[[str, GatewayError], str | None]:
    """Flow control's eviction: the Envoy stream whose request holds the lease ends now."""

    def evict(lease: str, error: GatewayError) -> str | None:
        for exchange in list(process.live):
            if any(lease == leg for leg, _ in engine_legs(exchange.plan)) and exchange.end_now(error):
                return str(exchange.request_id)
        return None

    return evict


def token_quota(config: TitoConfig) -> TokenQuota | None:
    """Tenants' tokens per minute, for every base of the process (API keys on): each of the
    gateway's processes (workers x replicas) its share, or all of them one count in Redis."""
    if config.tenancy.keys_file is None:
        return None
    return TokenQuota(config.tenancy, config.processor.workers * config.admission.replicas)


def _both(first: Callable[[str, str], None], second: Callable[[str, str], None]) -> Callable[[str, str], None]:
    def both(address: str, state: str) -> None:
        first(address, state)
        second(address, state)

    return both


def follow_membership(config: TitoConfig, services: Services) -> None:
    """With a discovered pool, Envoy's engines are what the endpoints file lists: worker 0
    writes every base model's members there now and on every change (one writer; the other
    workers converge on the same membership by themselves)."""
    if not discovered(config) or config.processor.worker_index != 0:
        return
    endpoints = EndpointsFile(config.listener.engine_endpoints_file)
    memberships = [base.membership for base in services.bases if base.membership is not None]

    def write() -> None:
        endpoints.write(member for membership in memberships for member in membership.addresses())

    for membership in memberships:
        membership.on_change = write
    write()


async def drain(services: Services, timeout_s: float) -> None:
    """SIGTERM: new streams get a 503 (and `/ready` says so, for Envoy's health check); open
    ones may finish for `timeout_s`, then end with an OpenAI error event and [DONE]."""
    process = services.process
    process.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    log.info("draining %d open streams (up to %g s)", process.active_exchanges, timeout_s)
    while process.active_exchanges and loop.time() < deadline:
        await asyncio.sleep(0.05)
    error = GatewayError(503, "the gateway is shutting down", code="draining")
    for exchange in list(process.live):
        exchange.end_now(error)
    while process.active_exchanges and loop.time() < deadline + 2:  # their last bytes go out
        await asyncio.sleep(0.05)


async def serve(
    config: TitoConfig,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    observability: Observability | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (or `stop`), then drain; cancellation stops at once."""
    if stop is None:  # before any port opens: a SIGTERM as soon as one answers is a clean stop
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    http, streams = http_client(config)
    async with http:
        services = await build_gateway(config, http, streams, observability)
        if services.observability.stages is not None:  # every task from here on is timed
            install(asyncio.get_running_loop(), clock)
        # Everything loaded so far (vLLM, torch, tokenizers: millions of objects) lives as long
        # as the process: out of the collector's reach, a full collection no longer stalls
        # every stream for up to a second (measured by the loop-lag monitor).
        gc.collect()
        gc.freeze()
        address = f"{config.processor.listen_host}:{config.processor.port}"
        stop_grpc = await start_grpc(config, services)
        admin = await start_admin(services, config.processor.listen_host, config.processor.admin_port)
        lag_monitor = asyncio.create_task(services.loop_lag.run())
        follow_membership(config, services)
        pollers = []
        for base in services.bases:
            if base.membership is not None:  # (its instances' scrapes and subscriptions too)
                pollers.append(asyncio.create_task(base.membership.run()))
            if base.capabilities is not None:
                pollers.append(asyncio.create_task(base.capabilities.run()))
            if base.tokenization.pool is not None:  # failed render endpoints probed back in
                pollers.append(asyncio.create_task(base.tokenization.pool.run()))
        if services.tenancy is not None and services.tenancy.keys is not None:  # revoked keys stop working
            pollers.append(asyncio.create_task(services.tenancy.keys.run()))
        worker = f"worker {config.processor.worker_index} " if config.processor.workers > 1 else ""
        log.info(
            "ext_proc %slistening on %s (gRPC server %s), admin on port %d",
            worker,
            address,
            config.processor.grpc_server,
            config.processor.admin_port,
        )
        if ready is not None:
            ready.set()
        try:
            await stop.wait()
            await drain(services, config.processor.drain_timeout_s)
        finally:
            lag_monitor.cancel()
            for task in pollers:
                task.cancel()
            admin.close()
            await stop_grpc(2.0)
            await asyncio.gather(lag_monitor, *pollers, return_exceptions=True)
            if services.planner.quota is not None:
                await services.planner.quota.close()
            await services.conversations.close()


async def start_grpc(config: TitoConfig, services: Services) -> Callable[[float], Awaitable[None]]:
    """The ext_proc service and the health service on the processor's gRPC port, served by
    `processor.grpc_server`; returns what stops it (open calls get a grace period)."""
    processor, health = ExternalProcessor(services), Health(services)
    limit = config.processor.grpc_max_message_bytes
    host, port = config.processor.listen_host, config.processor.port
    if config.processor.grpc_server == "h2":
        server = H2GrpcServer(
            {
                PROCESS: Method(ext_proc_pb.ProcessingRequest, processor.process, stream=True),
                HEALTH_CHECK: Method(health_pb2.HealthCheckRequest, health.check, stream=False),
            },
            max_message_bytes=limit,
            stream_window=STREAM_WINDOW,
        )
        await server.start(host, port)
        return server.stop
    aio = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            # BDP probing grew the windows to tens of MiB: measured +50 MiB RSS under 8
            # concurrent large uploads.
            ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", STREAM_WINDOW),
        ]
    )
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(processor, aio)
    health_pb2_grpc.add_HealthServicer_to_server(health, aio)  # GIE gateways and Kubernetes probes check the EPP here
    aio.add_insecure_port(f"{host}:{port}")
    await aio.start()
    return lambda grace: aio.stop(grace)
