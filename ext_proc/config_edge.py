"""The config of the gateway's edge: Envoy's OpenAI-facing listener (its public routes, edge
limits and admin port) and the gRPC ext_proc processor Envoy talks to (its ports, workers,
byte budgets and drain). They are the `listener` and `processor` sections of `TitoConfig`
(`ext_proc/config.py`), kept apart from the model, pool and routing sections because they
describe the processes and sockets a request crosses before any engine is involved.
"""

from __future__ import annotations

import functools
import re
from typing import Literal

from pydantic import Field, model_validator

from ext_proc.config_section import Section

MiB = 1 << 20


class PublicRoute(Section):
    """One method + path the listener serves; every other request gets a 404 from Envoy
    and reaches nothing. `handler` says who answers: chat/completions are rendered and
    routed token-only, as are Anthropic Messages (`messages`: chat inside the gateway, as in
    native vLLM; `messages_count_tokens`: render alone) and OpenAI Responses (`responses`:
    completions inside the gateway, stored in `conversation_store`; the stored responses are
    answered by the processor:
    `responses_retrieve`, `responses_delete`, `responses_input_items`, `responses_cancel`),
    `tokenize`/`detokenize` are answered by
    render alone (opt-in: not in the default table), passthrough goes to an engine untouched
    (never breaker input), health and models (the model catalog's /v1/models) are answered by
    the processor. Each rendered handler's client API is in `ext_proc/api/routes.py`.
    A path segment `{name}` matches any one segment (`/v1/responses/{response_id}`)."""

    method: Literal["GET", "POST", "DELETE"]
    path: str
    handler: Literal[
        "chat",
        "completions",
        "messages",
        "messages_count_tokens",
        "responses",
        "responses_retrieve",
        "responses_delete",
        "responses_input_items",
        "responses_cancel",
        "passthrough",
        "health",
        "models",
        "tokenize",
        "detokenize",
    ]

    @property
    def pattern(self) -> str:
        """The path as a regular expression (RE2 and Python alike, for Envoy's route and the
        processor's): each `{name}` a named group of one segment."""
        return _compiled(self.path).pattern

    def match(self, method: str, path: str) -> dict[str, str] | None:
        """The path's `{name}` segments if this route takes the request, else None."""
        if method != self.method:
            return None
        if "{" not in self.path:
            return {} if path == self.path else None
        found = _compiled(self.path).fullmatch(path)
        return None if found is None else found.groupdict()


@functools.lru_cache(maxsize=64)
def _compiled(path: str) -> re.Pattern[str]:
    """A route path's regular expression, made once per path (the processor matches every
    request's path against the table)."""
    return re.compile(re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(path)))


# The handlers of Anthropic's API, whose errors are in its envelope, not OpenAI's.
ANTHROPIC_HANDLERS = frozenset({"messages", "messages_count_tokens"})
DEFAULT_ROUTES = [
    PublicRoute(method="POST", path="/v1/chat/completions", handler="chat"),
    PublicRoute(method="POST", path="/v1/completions", handler="completions"),
    PublicRoute(method="POST", path="/v1/messages", handler="messages"),
    PublicRoute(method="POST", path="/v1/messages/count_tokens", handler="messages_count_tokens"),
    PublicRoute(method="POST", path="/v1/responses", handler="responses"),
    PublicRoute(method="GET", path="/v1/responses/{response_id}", handler="responses_retrieve"),
    PublicRoute(method="DELETE", path="/v1/responses/{response_id}", handler="responses_delete"),
    PublicRoute(method="GET", path="/v1/responses/{response_id}/input_items", handler="responses_input_items"),
    PublicRoute(method="POST", path="/v1/responses/{response_id}/cancel", handler="responses_cancel"),
    PublicRoute(method="GET", path="/v1/models", handler="models"),
    PublicRoute(method="GET", path="/health", handler="health"),
]


class ListenerConfig(Section):
    """Envoy's OpenAI-facing listener, its edge limits and its admin port."""

    host: str = "127.0.0.1"
    port: int = 8080
    admin_port: int = 9901
    # Envoy's admin (stats, /ready; also /quitquitquit): loopback unless a scraper needs it
    admin_host: str = "127.0.0.1"
    routes: list[PublicRoute] = Field(default_factory=lambda: list(DEFAULT_ROUTES))
    max_request_bytes: int = 32 * MiB  # request bodies; the processor answers 413 as bytes cross it
    stream_idle_timeout_s: int = 300
    request_headers_timeout_s: int = 10  # a client that never finishes its headers
    request_timeout_s: int = 60  # a client that never finishes its body (trickling uploads)
    max_concurrent_streams: int = 128  # per HTTP/2 client connection
    max_connections: int = 10000  # downstream connections, all listeners
    envoy_max_heap_bytes: int = 1 << 30  # overload manager: shed load before Envoy's heap reaches it
    # With a discovered pool: the engines' cluster is Envoy's EDS from this file, which the
    # processor (its worker 0) rewrites as instances join and leave, and Envoy watches. Both
    # must see the same path (one host, or a volume both mount).
    engine_endpoints_file: str = "/tmp/tito/engines.eds.json"

    @model_validator(mode="after")
    def _unique_routes(self) -> ListenerConfig:
        keys = [(r.method, r.path) for r in self.routes]
        if len(set(keys)) != len(keys) or any(not r.path.startswith("/") for r in self.routes):
            raise ValueError("listener.routes: each method+path once, paths starting with '/'")
        return self

    @property
    def anthropic_paths(self) -> str | None:
        """A regular expression (RE2) of the request paths, query string included, under the
        Anthropic Messages routes: Envoy's own replies there are in Anthropic's envelope. None:
        no such route."""
        paths = sorted({r.pattern for r in self.routes if r.handler in ANTHROPIC_HANDLERS})
        return f"^({'|'.join(paths)})([/?].*)?$" if paths else None

    def handler(self, method: str, path: str) -> str | None:
        """Who answers this request (query string ignored, as in Envoy's path match)."""
        found = self.route(method, path)
        return None if found is None else found[0].handler

    def route(self, method: str, path: str) -> tuple[PublicRoute, dict[str, str]] | None:
        """The route that takes this request, and its path's `{name}` segments."""
        path = path.split("?", 1)[0]
        for route in self.routes:
            if (params := route.match(method, path)) is not None:
                return route, params
        return None


class ProcessorConfig(Section):
    """The gRPC ext_proc server Envoy talks to."""

    host: str = "127.0.0.1"  # where Envoy reaches the processor
    listen_host: str = "127.0.0.1"  # what the processor binds (0.0.0.0 in containers)
    port: int = 9002
    admin_port: int = 9003  # /health, /debug/state, /metrics (on listen_host)
    grpc_max_message_bytes: int = 64 * MiB
    http_max_connections: int = 256
    max_streams: int = 2048  # concurrent ext_proc streams Envoy may open (its circuit breaker)
    max_response_bytes: int = 64 * MiB  # a buffered (non-streaming) engine response; over it: 502
    # Request bodies + buffered responses of all streams; over it: 503. None: one maximal
    # body (listener.max_request_bytes), so the processor's RSS stays within twice that under
    # any burst of uploads (the rest is transport buffers). Raise it for many large bodies.
    max_inflight_bytes: int | None = None
    fallback_tokenizer_timeout_s: float = 10.0  # the local tokenizer's chat template, per request
    # How many engines a pick names, in the order to try (x-gateway-destination-endpoint header
    # and envoy.lb metadata): 0 = every fallback (tito's Envoy, override_host gateways); 1 for
    # gateways routing with ORIGINAL_DST on the header (one address).
    destination_endpoints: int = Field(default=0, ge=0)
    # Processor-owned streams (fan-out, relay): SSE pieces waiting for the client, per request;
    # when full, the engine streams wait (backpressure), nothing is dropped.
    owned_queue_depth: int = 32
    # SIGTERM: open streams may finish this long; then they end with an error event
    drain_timeout_s: float = 30.0
    # Processor processes on this host (`tito processor --workers N`), each a gRPC server
    # Envoy balances streams over: one Python process tops out at a few thousand chunks/s.
    # Worker i takes the port pair `port + 2i`, `admin_port + 2i` (9002/9003, 9004/9005, ...).
    workers: int = Field(default=1, ge=1)
    worker_index: int = Field(default=0, ge=0)  # set by the supervisor for each worker
    # uvloop (what vLLM's API server runs on): the gRPC handling of each ext_proc message costs
    # about a quarter less CPU than on asyncio's own loop (`tests/bench/grpc_bench.py`).
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    # The gRPC server Envoy's ext_proc streams reach: `h2`, the processor's own HTTP/2
    # framing on the event loop (envoy_protocol/h2_server.py), or `grpcio` (grpc.aio), which
    # costs about twice the CPU per stream and per message (`tests/bench/grpc_bench.py`).
    grpc_server: Literal["h2", "grpcio"] = "h2"
    # Event-loop CPU per request stage at /debug/stages (`tests/bench/start_profile.py`):
    # every step of every task costs two more clock reads, so off unless profiling.
    profile_stages: bool = False

    @model_validator(mode="after")
    def _worker_ports_disjoint(self) -> ProcessorConfig:
        grpc, admin = (set(ports) for ports in zip(*self.worker_ports(), strict=True))
        if grpc & admin:
            raise ValueError(
                f"processor: {self.workers} workers take ports port + 2i and admin_port + 2i;"
                f" {sorted(grpc & admin)} would be both (make admin_port - port odd)"
            )
        return self

    def worker_ports(self) -> list[tuple[int, int]]:
        """(gRPC port, admin port) of every worker, worker 0 first."""
        base = 2 * self.worker_index
        return [(self.port - base + 2 * i, self.admin_port - base + 2 * i) for i in range(self.workers)]

    def for_worker(self, index: int) -> ProcessorConfig:
        """Worker `index`'s own ports (its admin port also serves its Trigger callbacks)."""
        shift = 2 * (index - self.worker_index)
        return self.model_copy(
            update={"port": self.port + shift, "admin_port": self.admin_port + shift, "worker_index": index}
        )
