"""`tito epp-check --epp HOST:PORT --model NAME`: the Gateway API Inference Extension's Endpoint
Picker protocol v1.0.0 (GIE `docs/proposals/004-endpoint-picker-protocol/README.md`) checked
against any EPP from the data plane's side.

A mini data plane speaks Envoy's ext_proc protocol to the EPP as Envoy does with both bodies
FULL_DUPLEX_STREAMED and trailers SEND, sends each request to the engine the EPP names, and
streams the engine's answer back through the EPP: what a conforming gateway would make of the
EPP's answers is what the checks judge. The engines must be reachable from where it runs.

One line per check (`PASS name`, `FAIL name: why`, `SKIP name: why`); exit status 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import ipaddress
import json
import sys
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.stubs import core_pb, ext_proc_grpc, ext_proc_pb, processing_mode_pb2

# The spec's names, stated here rather than imported from tito's own EPP side: a checker
# sharing the implementation's constants would share its mistakes.
# §Endpoint Subset [data plane -> EPP]: a list of "ip:port" (some gateways: one comma string).
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# §Destination Endpoint [EPP -> data plane]: this header and `envoy.lb` metadata key, equal.
LB_NAMESPACE = "envoy.lb"
DESTINATION_KEY = "x-gateway-destination-endpoint"
# §Destination Endpoint Served [data plane -> EPP, response]: the endpoint that answered.
SERVED_KEY = "x-gateway-destination-endpoint-served"
# §Health Checking: the gRPC health services an EPP exposes on its port.
HEALTH_SERVICES = ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")

BodySendMode = processing_mode_pb2.ProcessingMode.BodySendMode
FULL_DUPLEX = BodySendMode.Value("FULL_DUPLEX_STREAMED")
NO_BODY = BodySendMode.Value("NONE")

CHAT_PATH = "/v1/chat/completions"
FOREIGN = "192.0.2.1:9"  # TEST-NET-1 (RFC 5737): never a pool member
PICKS = 3  # plain requests in `pick`, whose destinations name the pool's endpoints
SUBSET_TRIES = 3  # requests per endpoint in `subset` (list form; one more as a comma string)
SHED_MAX_TOKENS = 4096  # a request an EPP under load sheds rather than queues
CLOSE_GRACE_S = 1.0  # how long a closed stream waits for the EPP to end its side
EXCERPT = 160  # bytes of a body quoted in a reason
# Set per hop by whoever sends the message on; an engine's are not the client's.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "upgrade"})

IMMEDIATE = "ImmediateResponse"
STREAMED_IMMEDIATE = "StreamedImmediateResponse"
UPSTREAM = "the engine"

Headers = dict[str, str]


class CheckError(Exception):
    """What the EPP did wrong, or did not do in time: the check FAILs with this reason."""


class Skip(Exception):
    """The check cannot tell anything about this EPP: it SKIPs with this reason."""


@dataclass(frozen=True)
class Request:
    """One client request, as the mini data plane hands it to the EPP."""

    body: bytes
    path: str = CHAT_PATH
    subset: list[str] | str | None = None  # §Endpoint Subset: a list, a comma string, or unset
    response_body_mode: int = FULL_DUPLEX
    request_id: str = field(default_factory=lambda: str(uuid.uuid4()))

    def headers(self) -> Headers:
        return {
            ":method": "POST",
            ":path": self.path,
            ":authority": "epp-check",
            ":scheme": "http",
            "content-type": "application/json",
            "content-length": str(len(self.body)),
            "x-request-id": self.request_id,
        }


@dataclass(frozen=True)
class Answer:
    """What the client gets, and from whom."""

    status: int
    headers: Headers
    body: bytes
    source: str  # IMMEDIATE or STREAMED_IMMEDIATE (the EPP answered itself), or UPSTREAM

    def describe(self) -> str:
        return f"{self.status} ({self.source}: {self.body[:EXCERPT]!r})"


@dataclass
class Decision:
    """The EPP's answer to the request phase: the request as it goes upstream (its headers
    mutated, its body possibly rewritten) and where to, or the EPP's own answer."""

    headers: Headers
    body: bytes
    metadata_destination: str | None = None
    answer: Answer | None = None

    @property
    def header_destination(self) -> str | None:
        return self.headers.get(DESTINATION_KEY)

    @property
    def endpoints(self) -> list[str]:
        """The ordered fallback list (§Destination Endpoint), the header's if both are set."""
        return split(self.header_destination or self.metadata_destination or "")

    @property
    def path(self) -> str:
        return self.headers.get(":path", "")


@dataclass(frozen=True)
class Outcome:
    """One request end to end: the EPP's decision, the endpoint that served it (None when the
    EPP answered itself) and the client's answer."""

    decision: Decision
    served: str | None
    answer: Answer


@dataclass(frozen=True)
class Upstream:
    """The engine answering: which endpoint, and its response (still streaming)."""

    served: str
    response: httpx.Response


def split(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def valid_endpoint(name: str) -> bool:
    """§Destination Endpoint's <ip:port>: an IPv4 address or a bracketed IPv6 one, a port."""
    host, colon, port = name.rpartition(":")
    if not colon or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        return False
    try:
        if host.startswith("[") and host.endswith("]"):
            ipaddress.IPv6Address(host[1:-1])
        else:
            ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


class Pieces:
    """A body as the EPP hands it back, against the pieces sent to it. FULL_DUPLEX_STREAMED:
    `streamed_response` pieces of any number and size, the last with end_of_stream. Other
    answers come one per piece sent: its replacement (`body`), nothing (`clear_body`), or no
    mutation at all, the piece unchanged."""

    def __init__(self) -> None:
        self._sent: list[bytes] = []
        self._sent_all = False
        self._out: list[bytes] = []
        self._answered = 0
        self._streamed_end = False

    def sent(self, piece: bytes, end: bool) -> None:
        """Record a piece before it goes out: its answer may come back at once."""
        self._sent.append(piece)
        self._sent_all = end

    def take(self, mutation: Any) -> None:
        """One of the EPP's body answers (a BodyMutation)."""
        kind = mutation.WhichOneof("mutation")
        if kind == "streamed_response":
            self._out.append(mutation.streamed_response.body)
            self._streamed_end = self._streamed_end or mutation.streamed_response.end_of_stream
            return
        if self._answered == len(self._sent):
            raise CheckError("the EPP answered a body piece that was never sent")
        original = self._sent[self._answered]
        self._answered += 1
        self._out.append(mutation.body if kind == "body" else b"" if kind == "clear_body" else original)

    @property
    def ended(self) -> bool:
        return self._streamed_end or (self._sent_all and self._answered == len(self._sent))

    @property
    def body(self) -> bytes:
        return b"".join(self._out)


class EppStream:
    """One ext_proc stream, i.e. one HTTP request. The EPP's answers are read in the background
    into an inbox, so every wait has a deadline and a failing sender can end the wait too."""

    def __init__(self, call: Any, timeout: float) -> None:
        self._call = call
        self._timeout = timeout
        self._inbox: asyncio.Queue[Any] = asyncio.Queue()  # answers, then None (EOF) or an error
        self._reader = asyncio.create_task(self._read())

    async def __aenter__(self) -> EppStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _read(self) -> None:
        try:
            while (message := await self._call.read()) is not grpc.aio.EOF:
                self._inbox.put_nowait(message)
        except grpc.aio.AioRpcError as error:
            self._inbox.put_nowait(CheckError(f"the EPP ended the stream with {error.code().name}: {error.details()}"))
            return
        self._inbox.put_nowait(None)

    async def send(self, message: Any) -> None:
        try:
            await asyncio.wait_for(self._call.write(message), self._timeout)
        except TimeoutError:
            raise CheckError(f"the EPP took no message for {self._timeout:g} s") from None
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as error:
            raise CheckError(f"the EPP's stream ended before the data plane was done: {error}") from None

    async def receive(self, waiting_for: str) -> Any:
        """The EPP's next ProcessingResponse."""
        try:
            item = await asyncio.wait_for(self._inbox.get(), self._timeout)
        except TimeoutError:
            raise CheckError(f"no answer from the EPP within {self._timeout:g} s, waiting for {waiting_for}") from None
        if item is None:
            raise CheckError(f"the EPP ended the stream while the data plane waited for {waiting_for}")
        if isinstance(item, Exception):
            raise item
        return item

    def fail(self, error: CheckError) -> None:
        """End the current wait with this error (the sender's side broke)."""
        self._inbox.put_nowait(error)

    async def close(self) -> None:
        """As the data plane ends a stream: half-close, let the EPP end its side, then cancel."""
        with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError, TimeoutError):
            await asyncio.wait_for(self._call.done_writing(), CLOSE_GRACE_S)
        await asyncio.wait({self._reader}, timeout=min(CLOSE_GRACE_S, self._timeout))
        self._call.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


class MiniDataPlane:
    """The data plane's side of the protocol, one method per phase of a request: what Envoy
    does around an EPP (`request_phase`, `response_phase`), and the proxying between them
    (`upstream`: the destination's fallback list, which endpoint served)."""

    def __init__(self, epp: str, timeout: float) -> None:
        self.timeout = timeout
        self._channel = grpc.aio.insecure_channel(epp)
        self._processor = ext_proc_grpc.ExternalProcessorStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._http = httpx.AsyncClient(timeout=timeout)

    async def __aenter__(self) -> MiniDataPlane:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()
        await self._channel.close()

    def open(self) -> EppStream:
        return EppStream(self._processor.Process(), self.timeout)

    async def health(self, service: str) -> str:
        """§Health Checking: the service's status name, or why the EPP gave none."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)
        except grpc.aio.AioRpcError as error:
            return f"{error.code().name} ({error.details()})"
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    async def exchange(self, request: Request, vet: Callable[[Decision], object] | None = None) -> Outcome:
        """One request end to end. `vet` judges the decision before anything goes upstream
        (a destination outside the pool is never connected to)."""
        async with self.open() as stream:
            decision = await self.request_phase(stream, request)
            if vet is not None:
                vet(decision)
            return await self.complete(stream, request, decision)

    async def complete(
        self, stream: EppStream, request: Request, decision: Decision, skip_first: bool = False
    ) -> Outcome:
        """The rest of a request after the EPP's decision: upstream, then the response phase."""
        if decision.answer is not None:
            return Outcome(decision, None, decision.answer)
        upstream = await self.upstream(decision, skip_first)
        try:
            answer = await self.response_phase(stream, upstream, request.response_body_mode)
        finally:
            await upstream.response.aclose()
        return Outcome(decision, upstream.served, answer)

    async def request_phase(self, stream: EppStream, request: Request) -> Decision:
        """The request's headers (with the body modes and any §Endpoint Subset) and body go
        to the EPP at once: a FULL_DUPLEX EPP may answer the headers only after the body's end.
        Then its answers until both are settled, or until it answers the client itself."""
        await stream.send(_request_headers(request))
        pieces = Pieces()
        pieces.sent(request.body, end=True)
        await stream.send(
            ext_proc_pb.ProcessingRequest(request_body=ext_proc_pb.HttpBody(body=request.body, end_of_stream=True))
        )
        decision = Decision(headers=request.headers(), body=request.body)
        headed = False
        while not (headed and pieces.ended):
            message = await stream.receive("the answers to the request's headers and body")
            decision.metadata_destination = _metadata_destination(message) or decision.metadata_destination
            kind = message.WhichOneof("response")
            if kind in ("immediate_response", "streamed_immediate_response"):
                decision.answer = await self._epp_answer(stream, message)
                return decision
            if kind == "request_headers":
                _apply(decision.headers, message.request_headers.response.header_mutation)
                headed = True
            elif kind == "request_body":
                _apply(decision.headers, message.request_body.response.header_mutation)
                pieces.take(message.request_body.response.body_mutation)
            elif kind != "request_trailers":
                raise CheckError(f"unexpected {kind} answer in the request phase")
        decision.body = pieces.body
        return decision

    async def upstream(self, decision: Decision, skip_first: bool = False) -> Upstream:
        """Proxying (§Destination Endpoint: the first valid endpoint of the list is used; with
        retries the proxy walks down it): the request goes to the first endpoint that takes
        the connection. skip_first: as if the first had failed, which then gets nothing."""
        failures: list[str] = []
        for endpoint in decision.endpoints[1:] if skip_first else decision.endpoints:
            request = self._http.build_request(
                "POST", f"http://{endpoint}{decision.path}", headers=_forwarded(decision.headers), content=decision.body
            )
            try:
                return Upstream(endpoint, await self._http.send(request, stream=True))
            except (httpx.ConnectError, httpx.ConnectTimeout) as error:
                failures.append(f"{endpoint}: {error!r}")
        tried = "; ".join(failures) or "none to try"
        raise CheckError(f"no endpoint of the destination {decision.endpoints} took the request ({tried})")

    async def response_phase(self, stream: EppStream, upstream: Upstream, body_mode: int) -> Answer:
        """The engine's answer through the EPP: its headers with the §Destination Endpoint
        Served report, then (body mode not NONE) its body piece by piece as it arrives, while
        the EPP's answers are read: what the client gets."""
        headers = _upstream_headers(upstream.response)
        await stream.send(
            ext_proc_pb.ProcessingRequest(
                response_headers=ext_proc_pb.HttpHeaders(headers=_header_map(headers)),
                metadata_context=_served(upstream.served),
            )
        )
        if body_mode == NO_BODY:
            return await self._read_response(stream, upstream, headers, None)
        pieces = Pieces()
        sender = asyncio.create_task(self._send_body(stream, upstream.response, pieces))
        try:
            return await self._read_response(stream, upstream, headers, pieces)
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)

    async def _send_body(self, stream: EppStream, response: httpx.Response, pieces: Pieces) -> None:
        """Each piece as the engine sends it, then an empty last one with end_of_stream."""
        try:
            async for chunk in response.aiter_bytes():
                await _send_piece(stream, pieces, chunk, end=False)
            await _send_piece(stream, pieces, b"", end=True)
        except httpx.HTTPError as error:
            stream.fail(CheckError(f"the engine's answer broke off: {error!r}"))
        except CheckError as error:
            stream.fail(error)

    async def _read_response(
        self, stream: EppStream, upstream: Upstream, headers: Headers, pieces: Pieces | None
    ) -> Answer:
        """The EPP's answers to the response phase; pieces None: the body bypasses the EPP."""
        headed = False
        while not (headed and (pieces is None or pieces.ended)):
            message = await stream.receive("the answers to the engine's response")
            kind = message.WhichOneof("response")
            if kind == "immediate_response":
                return _immediate(message.immediate_response)
            if kind == "response_headers":
                _apply(headers, message.response_headers.response.header_mutation)
                headed = True
            elif kind == "response_body" and pieces is not None:
                pieces.take(message.response_body.response.body_mutation)
            elif kind != "response_trailers":
                raise CheckError(f"unexpected {kind} answer in the response phase")
        body = await upstream.response.aread() if pieces is None else pieces.body
        return Answer(_status(headers), headers, body, UPSTREAM)

    async def _epp_answer(self, stream: EppStream, message: Any) -> Answer:
        """The EPP's own answer: an ImmediateResponse, or a StreamedImmediateResponse (its
        headers, then body pieces up to end_of_stream, or trailers)."""
        if message.WhichOneof("response") == "immediate_response":
            return _immediate(message.immediate_response)
        headers: Headers = {}
        body: list[bytes] = []
        while True:
            part = message.streamed_immediate_response
            kind = part.WhichOneof("response")
            if kind == "headers_response":
                headers.update(_headers(part.headers_response.headers))
                if part.headers_response.end_of_stream:
                    break
            elif kind == "body_response":
                body.append(part.body_response.body)
                if part.body_response.end_of_stream:
                    break
            else:  # trailers end it
                break
            message = await stream.receive("the rest of the EPP's streamed answer")
            if message.WhichOneof("response") != "streamed_immediate_response":
                raise CheckError(f"{message.WhichOneof('response')} in the middle of the EPP's streamed answer")
        return Answer(_status(headers), headers, b"".join(body), STREAMED_IMMEDIATE)


async def _send_piece(stream: EppStream, pieces: Pieces, piece: bytes, end: bool) -> None:
    pieces.sent(piece, end)
    await stream.send(ext_proc_pb.ProcessingRequest(response_body=ext_proc_pb.HttpBody(body=piece, end_of_stream=end)))


def _request_headers(request: Request) -> Any:
    """The stream's first message: the headers, the body modes (Envoy sends them on the first
    message only) and, when testing one, the §Endpoint Subset."""
    message = ext_proc_pb.ProcessingRequest(
        request_headers=ext_proc_pb.HttpHeaders(headers=_header_map(request.headers())),
        protocol_config=ext_proc_pb.ProtocolConfiguration(
            request_body_mode=FULL_DUPLEX, response_body_mode=request.response_body_mode
        ),
    )
    if request.subset is not None:
        message.metadata_context.filter_metadata[SUBSET_NAMESPACE].update({SUBSET_KEY: request.subset})
    return message


def _served(endpoint: str) -> Any:
    metadata = core_pb.Metadata()
    metadata.filter_metadata[LB_NAMESPACE].update({SERVED_KEY: endpoint})
    return metadata


def _header_map(headers: Headers) -> Any:
    return core_pb.HeaderMap(headers=[core_pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()])


def _header_value(header: Any) -> str:
    """A HeaderValue's text: `raw_value` (what Envoy sends) or `value`."""
    return header.raw_value.decode("utf-8", "replace") if header.raw_value else str(header.value)


def _headers(header_map: Any) -> Headers:
    return {h.key.lower(): _header_value(h) for h in header_map.headers}


def _apply(headers: Headers, mutation: Any) -> None:
    """A HeaderMutation, as Envoy applies it (a set header replaces the one there)."""
    for name in mutation.remove_headers:
        headers.pop(name.lower(), None)
    for option in mutation.set_headers:
        headers[option.header.key.lower()] = _header_value(option.header)


def _metadata_destination(message: Any) -> str | None:
    """§Destination Endpoint's dynamic_metadata `envoy.lb` entry, as text (a value other than
    a string is shown as JSON, so that it differs from any header)."""
    namespace = message.dynamic_metadata.fields.get(LB_NAMESPACE)
    if namespace is None or namespace.WhichOneof("kind") != "struct_value":
        return None
    value = namespace.struct_value.fields.get(DESTINATION_KEY)
    if value is None:
        return None
    if value.WhichOneof("kind") == "string_value":
        return str(value.string_value)
    return json.dumps(json_format.MessageToDict(value))


def _immediate(response: Any) -> Answer:
    headers: Headers = {}
    _apply(headers, response.headers)
    return Answer(int(response.status.code), headers, bytes(response.body), IMMEDIATE)


def _status(headers: Headers) -> int:
    status = headers.get(":status", "")
    if not status.isdigit():
        raise CheckError(f"the client's answer has no valid :status ({status!r})")
    return int(status)


def _forwarded(headers: Headers) -> Headers:
    """The request headers an engine gets: the mutated ones but pseudo-headers and those
    the HTTP client sets itself; an unencoded answer, so the EPP sees the engine's bytes."""
    own = {"content-length", "host", "accept-encoding"}
    forwarded = {k: v for k, v in headers.items() if not k.startswith(":") and k not in own}
    return {**forwarded, "accept-encoding": "identity"}


def _upstream_headers(response: httpx.Response) -> Headers:
    headers = {":status": str(response.status_code)}
    headers.update({k.lower(): v for k, v in response.headers.items() if k.lower() not in HOP_BY_HOP})
    return headers


# -- the checks ---------------------------------------------------------------------------------


@dataclass
class Context:
    """What the checks share: the data plane, and the pool's endpoints once known."""

    plane: MiniDataPlane
    model: str
    endpoints: list[str] = field(default_factory=list)
    shed: int | None = None


@dataclass(frozen=True)
class Result:
    name: str
    status: str  # PASS, FAIL or SKIP
    why: str = ""

    def line(self) -> str:
        return f"{self.status} {self.name}: {self.why}" if self.why else f"{self.status} {self.name}"


def chat(model: str, stream: bool = False, max_tokens: int = 8) -> bytes:
    messages = [{"role": "user", "content": "Say hi"}]
    return json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "stream": stream}).encode()


def expect_destination(decision: Decision) -> list[str]:
    """§Destination Endpoint: the header and the `envoy.lb` dynamic metadata both name the
    pick, equal, as <ip:port> or an ordered <ip:port>,<ip:port>,... list; that list."""
    if decision.answer is not None:
        raise CheckError(f"no destination: the EPP answered {decision.answer.describe()}")
    header, metadata = decision.header_destination, decision.metadata_destination
    if header is None:
        raise CheckError(f"no {DESTINATION_KEY} header set on the request headers")
    if metadata is None:
        raise CheckError(f"no dynamic_metadata {LB_NAMESPACE}/{DESTINATION_KEY}")
    if split(header) != split(metadata):
        raise CheckError(f"the header names {header!r}, the metadata {metadata!r}: they must be equal")
    endpoints = split(header)
    if not endpoints or not all(valid_endpoint(e) for e in endpoints):
        raise CheckError(f"{DESTINATION_KEY} {header!r} is not <ip:port>[,<ip:port>...]")
    return endpoints


def expect_completion(answer: Answer, what: str) -> None:
    """A chat completion reached the client: 200 and a JSON body with `choices`."""
    if answer.status != 200:
        raise CheckError(f"{what}: the client got {answer.describe()}")
    try:
        body = json.loads(answer.body)
    except ValueError:
        raise CheckError(f"{what}: the client's body is not JSON: {answer.body[:EXCERPT]!r}") from None
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        raise CheckError(f"{what}: no `choices` in the client's body: {answer.body[:EXCERPT]!r}")


def expect_events(answer: Answer) -> None:
    """A chat completion stream reached the client: 200, `data:` events of JSON, `[DONE]` last."""
    if answer.status != 200:
        raise CheckError(f"the client got {answer.describe()}")
    lines = answer.body.decode("utf-8", "replace").splitlines()
    data = [line.removeprefix("data:").strip() for line in lines if line.startswith("data:")]
    if not data or data[-1] != "[DONE]":
        raise CheckError(f"the client's stream does not end with `data: [DONE]`: ...{answer.body[-EXCERPT:]!r}")
    for event in data[:-1]:
        try:
            json.loads(event)
        except ValueError:
            raise CheckError(f"an event is not JSON: {event[:EXCERPT]!r}") from None


def _destination_unless_answered(decision: Decision) -> None:
    if decision.answer is None:
        expect_destination(decision)


async def check_health(ctx: Context) -> str:
    """§Health Checking: liveness, readiness and the ext_proc service all SERVING."""
    statuses = {service: await ctx.plane.health(service) for service in HEALTH_SERVICES}
    wrong = [f"{service} {status}" for service, status in statuses.items() if status != "SERVING"]
    if wrong:
        raise CheckError(f"not SERVING: {'; '.join(wrong)}")
    return ""


async def discover(ctx: Context) -> list[str]:
    """A few plain requests end to end, each with a valid §Destination Endpoint: the pool's
    endpoints they name, in the order first named."""
    seen: list[str] = []
    for n in range(1, PICKS + 1):
        outcome = await ctx.plane.exchange(Request(chat(ctx.model)), vet=expect_destination)
        expect_completion(outcome.answer, f"request {n}")
        seen += [e for e in outcome.decision.endpoints if e not in seen]
    return seen


async def check_pick(ctx: Context) -> str:
    seen = await discover(ctx)
    ctx.endpoints = ctx.endpoints or seen
    return f"{PICKS} requests answered; the EPP named {', '.join(seen)}"


async def known_endpoints(ctx: Context) -> list[str]:
    """--endpoints, else those `pick` saw (learnt now when it did not run)."""
    if not ctx.endpoints:
        try:
            ctx.endpoints = await discover(ctx)
        except CheckError as error:
            raise CheckError(f"cannot learn the pool's endpoints: {error}") from None
    return ctx.endpoints


def _within(subset: list[str] | str, endpoint: str, decision: Decision) -> None:
    try:
        outside = [e for e in expect_destination(decision) if e != endpoint]
    except CheckError as error:
        raise CheckError(f"subset {subset!r}: {error}") from None
    if outside:
        raise CheckError(f"subset {subset!r}: the destination names {', '.join(outside)}, outside it")


async def _kept_to(ctx: Context, subset: list[str] | str, endpoint: str) -> None:
    outcome = await ctx.plane.exchange(
        Request(chat(ctx.model), subset=subset), vet=functools.partial(_within, subset, endpoint)
    )
    expect_completion(outcome.answer, f"subset {subset!r}")


async def check_subset(ctx: Context) -> str:
    """§Endpoint Subset: the EPP picks only from it, as a list and as a comma string (here
    with a foreign address the EPP must pass over)."""
    endpoints = await known_endpoints(ctx)
    for endpoint in endpoints:
        for _ in range(SUBSET_TRIES):
            await _kept_to(ctx, [endpoint], endpoint)
        await _kept_to(ctx, f"{endpoint},{FOREIGN}", endpoint)
    if len(endpoints) == 1:
        return f"only {endpoints[0]} known: an EPP ignoring the subset passes too (give --endpoints A,B)"
    return f"kept to each of {len(endpoints)} endpoints, as a list and as a comma string"


async def _refused(ctx: Context, subset: list[str]) -> str:
    """§Endpoint Subset: none eligible, ImmediateResponse 503 and no destination."""
    async with ctx.plane.open() as stream:
        decision = await ctx.plane.request_phase(stream, Request(chat(ctx.model), subset=subset))
    named = decision.header_destination or decision.metadata_destination
    if decision.answer is None:
        raise CheckError(f"picked {named!r} from subset {subset!r}: expected ImmediateResponse 503")
    if decision.answer.source != IMMEDIATE or decision.answer.status != 503:
        raise CheckError(f"subset {subset!r}: answered {decision.answer.describe()}, expected ImmediateResponse 503")
    if named:
        raise CheckError(f"subset {subset!r}: 503, yet named a destination {named!r}")
    return ""


async def check_subset_empty(ctx: Context) -> str:
    return await _refused(ctx, [])


async def check_subset_foreign(ctx: Context) -> str:
    return await _refused(ctx, [FOREIGN])


async def check_served(ctx: Context) -> str:
    """§Destination Endpoint Served: the data plane walked down the list (its first endpoint
    "failed", and never gets the request) and reports the second as served; the EPP must
    carry the answer through all the same."""
    request = Request(chat(ctx.model))
    async with ctx.plane.open() as stream:
        decision = await ctx.plane.request_phase(stream, request)
        endpoints = expect_destination(decision)
        if len(endpoints) < 2:
            raise Skip(f"the EPP names one endpoint per pick ({endpoints[0]}): no fallback to report as served")
        outcome = await ctx.plane.complete(stream, request, decision, skip_first=True)
    expect_completion(outcome.answer, f"served by {outcome.served}, not the first pick {endpoints[0]}")
    return f"{outcome.served} reported as served instead of the first pick {endpoints[0]}; the client got 200"


async def check_streaming(ctx: Context) -> str:
    outcome = await ctx.plane.exchange(Request(chat(ctx.model, stream=True)), vet=_destination_unless_answered)
    expect_events(outcome.answer)
    return f"routed to {outcome.served}" if outcome.served else "answered by the EPP itself"


async def check_shed(ctx: Context) -> str:
    """§Destination Endpoint: a request the EPP drops gets ImmediateResponse 429 (503 means
    no ready endpoint). Requests are held open after their pick, up to --shed of them."""
    if ctx.shed is None:
        raise Skip("run with --shed N to hold up to N requests open until one is shed")
    held: list[EppStream] = []
    try:
        for n in range(1, ctx.shed + 1):
            held.append(ctx.plane.open())
            decision = await ctx.plane.request_phase(held[-1], Request(chat(ctx.model, max_tokens=SHED_MAX_TOKENS)))
            answer = decision.answer
            if answer is None:
                continue
            if answer.source == IMMEDIATE and answer.status == 429:
                return f"request {n} shed with 429 while {n - 1} were held"
            raise CheckError(f"request {n} (with {n - 1} held) got {answer.describe()}, expected ImmediateResponse 429")
        raise CheckError(f"no request shed with 429 while up to {ctx.shed} were held")
    finally:
        await asyncio.gather(*(stream.close() for stream in held))


def _same_route(request: Request, decision: Decision) -> None:
    expect_destination(decision)
    if decision.path != request.path:
        raise CheckError(
            f"rewrote :path to {decision.path!r} although the gateway sends it no response body:"
            " the client would get that route's answer untranslated"
        )


async def check_no_response_body(ctx: Context) -> str:
    """A gateway that sends no response body (response_body_mode NONE): the EPP still names a
    destination, and keeps the client's route, whose answer then reaches the client as is."""
    request = Request(chat(ctx.model), response_body_mode=NO_BODY)
    outcome = await ctx.plane.exchange(request, vet=functools.partial(_same_route, request))
    expect_completion(outcome.answer, "response_body_mode NONE")
    return ""


Check = Callable[[Context], Awaitable[str]]  # the PASS note; raises CheckError (FAIL) or Skip
CHECKS: dict[str, Check] = {
    "health": check_health,
    "pick": check_pick,
    "subset": check_subset,
    "subset-empty": check_subset_empty,
    "subset-foreign": check_subset_foreign,
    "served": check_served,
    "streaming": check_streaming,
    "shed": check_shed,
    "no-response-body": check_no_response_body,
}


def selected(only: str | None) -> list[str]:
    return [name for name in CHECKS if not only or only in name]


async def run_check(name: str, ctx: Context) -> Result:
    try:
        return Result(name, "PASS", await CHECKS[name](ctx))
    except Skip as skip:
        return Result(name, "SKIP", str(skip))
    except CheckError as error:
        return Result(name, "FAIL", str(error))
    except httpx.HTTPError as error:  # the engine's side, e.g. its answer timed out
        return Result(name, "FAIL", f"talking to the engine: {error!r}")


async def run_checks(
    args: argparse.Namespace, report: Callable[[Result], object] = lambda result: None
) -> list[Result]:
    """The selected checks in order, each result reported as it is known."""
    results: list[Result] = []
    async with MiniDataPlane(args.epp, args.timeout) as plane:
        ctx = Context(plane, args.model, list(args.endpoints), args.shed)
        for name in selected(args.only):
            results.append(await run_check(name, ctx))
            report(results[-1])
    return results


def _endpoint_list(value: str) -> list[str]:
    endpoints = split(value)
    wrong = [e for e in endpoints if not valid_endpoint(e)]
    if not endpoints or wrong:
        raise argparse.ArgumentTypeError(f"not ip:port: {', '.join(wrong) or repr(value)}")
    return endpoints


def _positive(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"not a positive integer: {value!r}")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epp", required=True, metavar="HOST:PORT", help="the EPP's gRPC address (ext_proc, health)")
    parser.add_argument("--model", required=True, help="the model the test requests name")
    parser.add_argument(
        "--endpoints",
        type=_endpoint_list,
        default=[],
        metavar="IP:PORT,...",
        help="the pool's endpoints, for `subset` (default: those the EPP names in plain requests)",
    )
    parser.add_argument(
        "--shed", type=_positive, metavar="N", help="hold up to N requests open until one is shed (default: skip)"
    )
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S", help="seconds any wait lasts (default: 60)")
    parser.add_argument("--only", metavar="SUBSTR", help="run only the checks whose name contains this")


def run(args: argparse.Namespace) -> int:
    if not selected(args.only):
        print(f"no check matches {args.only!r}; checks: {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    results = asyncio.run(run_checks(args, lambda result: print(result.line(), flush=True)))
    counts = {status: sum(r.status == status for r in results) for status in ("PASS", "FAIL", "SKIP")}
    print(", ".join(f"{n} {status}" for status, n in counts.items()), file=sys.stderr)
    return 1 if counts["FAIL"] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tito epp-check", description="an Endpoint Picker (GIE EPP protocol v1) checked as its data plane would"
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
