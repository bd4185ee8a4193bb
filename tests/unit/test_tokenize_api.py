"""`/tokenize` and `/detokenize` (`ext_proc/api/tokenize.py`) over a fake render: render's
status and body come back unchanged, the body reaches render named after the base model,
endpoints are picked and judged as renders are (breakers, one retry elsewhere), no render
is a 503 `render_unavailable`, and through the whole exchange nothing reaches an engine.
(Equality with a native engine's answers, on the real render and engine:
`tests/integration/test_tokenize_api.py`.)"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import httpx
import orjson
import pytest

from ext_proc.api.tokenize import TokenizeApi, in_process_routes
from ext_proc.frontend.render import RenderClient
from ext_proc.frontend.render_in_process import InProcessRender, as_fastapi_validates
from ext_proc.frontend.render_pool import RenderMember, RenderPool, pool_member
from ext_proc.planning.plan import Local
from scheduler import BreakerState

TOKENS = b'{"count":2,"max_model_len":2048,"tokens":[9,8],"token_strs":null}'
NOT_FOUND = b'{"error":{"message":"The model `x` does not exist.","type":"NotFoundError","param":"model","code":404}}'
INVALID = b'{"error":{"message":"[{\'type\': \'missing\'}]","type":"Bad Request","param":null,"code":400}}'
NOT_IMPLEMENTED = b'{"error":{"message":"no tokenizer","type":"NotImplementedError","param":null,"code":501}}'
PROMPT = {"model": "tiny", "prompt": "hello"}


class Sidecars:
    """Render endpoints: real HTTP servers on loopback, scripted per name: (status, body), or
    the connection dropped once the request is read."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, bytes, str | None]] = []  # name, path, body, x-request-id
        self.answers: dict[str, tuple[int, bytes] | None] = {}
        self._servers: dict[str, asyncio.Server] = {}

    def answer(self, name: str, status: int, body: bytes) -> None:
        self.answers[name] = (status, body)

    def fail(self, name: str) -> None:
        self.answers[name] = None

    async def url(self, name: str) -> str:
        if name not in self._servers:
            self._servers[name] = await asyncio.start_server(partial(self._serve, name), "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._servers[name].sockets[0].getsockname()[1]}"

    async def _serve(self, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                fields = [line.partition(":") for line in lines[1:] if line]
                headers = {key.strip().lower(): value.strip() for key, _, value in fields}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.calls.append((name, lines[0].split(" ")[1], body, headers.get("x-request-id")))
                if (answer := self.answers[name]) is None:
                    return
                status, content = answer
                head = b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                writer.write(head % (status, len(content)) + content)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        for server in self._servers.values():
            server.close()


@pytest.fixture
def sidecars() -> Iterator[Sidecars]:
    fake = Sidecars()
    yield fake
    fake.close()


class FakeInProcess(InProcessRender):
    """vLLM's renderer loaded in process, answering as the sidecar's routes would."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(serving=None, args=None)
        self.answered = (status, body)
        self.asked: list[tuple[str, bytes]] = []

    async def answer(self, path: str, raw: bytes, request_id: str) -> tuple[int, bytes]:
        self.asked.append((path, raw))
        return self.answered


async def _pool(sidecars: Sidecars, *names: str, clock: Callable[[], float] = lambda: 0.0) -> RenderPool:
    """The render pool's sidecar endpoints, as the server builds them, over `sidecars`."""
    urls = [await sidecars.url(name) for name in names]
    members = [pool_member(url.removeprefix("http://"), url, RenderClient(url, 5000), 5.0) for url in urls]
    return RenderPool(members, "tiny", p99_budget_ms=1000.0, clock=clock)


def _api(pool: RenderPool | None) -> TokenizeApi:
    return TokenizeApi(pool, "tiny")


async def _plan(api: TokenizeApi, handler: str, body: dict[str, Any]) -> Local:
    plan = await api.plan(handler, body, orjson.dumps(body), "rid-1")
    assert isinstance(plan, Local)
    return plan


def _breaker(pool: RenderPool, index: int) -> BreakerState:
    member: RenderMember = pool.members[index]
    return member.breaker.state


def _error(plan: Local) -> dict[str, Any]:
    error: dict[str, Any] = orjson.loads(plan.body)["error"]
    return error


@pytest.mark.parametrize(
    ("handler", "body", "status", "answer"),
    [
        ("tokenize", PROMPT, 200, TOKENS),
        ("tokenize", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, 200, TOKENS),
        ("detokenize", {"model": "tiny", "tokens": [9, 8]}, 200, b'{"prompt":"hello"}'),
        ("tokenize", {"model": "tiny"}, 400, INVALID),
        ("detokenize", {"model": "tiny", "tokens": [10**12]}, 400, INVALID),
        ("tokenize", PROMPT, 404, NOT_FOUND),
        ("tokenize", PROMPT, 501, NOT_IMPLEMENTED),  # vLLM's own 501 (an OpenAI error): the route's answer
    ],
)
async def test_renders_status_and_body_come_back_unchanged_from_its_route(
    sidecars: Sidecars, handler: str, body: dict[str, Any], status: int, answer: bytes
) -> None:
    sidecars.answer("r1", status, answer)
    pool = await _pool(sidecars, "r1")
    plan = await _plan(_api(pool), handler, body)
    assert plan == Local(status, answer)
    assert sidecars.calls == [("r1", f"/{handler}", orjson.dumps(body), "rid-1")]
    assert _breaker(pool, 0) is BreakerState.CLOSED  # a verdict on the request, not the endpoint


@pytest.mark.parametrize(
    ("body", "sent"),
    [
        ({"model": "tiny-alias", "prompt": "hi"}, {"model": "tiny", "prompt": "hi"}),  # an alias or adapter
        ({"model": None, "prompt": "hi"}, {"model": "tiny", "prompt": "hi"}),
        ({"prompt": "hi", "add_special_tokens": False}, None),  # no model: as the client sent it
        ({"model": "tiny", "prompt": "hi"}, None),
    ],
)
async def test_render_gets_the_body_named_after_the_base_model(
    sidecars: Sidecars, body: dict[str, Any], sent: Any
) -> None:
    sidecars.answer("r1", 200, TOKENS)
    raw = orjson.dumps(body, option=orjson.OPT_INDENT_2)  # the client's own bytes
    await _api(await _pool(sidecars, "r1")).plan("tokenize", body, raw, "rid-1")
    [(_, _, content, _)] = sidecars.calls
    assert content == raw if sent is None else orjson.loads(content) == sent


async def test_without_render_it_is_a_503_render_unavailable(sidecars: Sidecars) -> None:
    plan = await _plan(_api(None), "tokenize", PROMPT)
    assert plan.status == 503
    assert _error(plan)["code"] == "render_unavailable" and "disabled" in _error(plan)["message"]
    assert sidecars.calls == []


async def test_a_failing_endpoint_opens_its_breaker_and_another_one_answers(sidecars: Sidecars) -> None:
    sidecars.answer("r1", 500, b'{"error":{"message":"boom","type":"InternalServerError","param":null,"code":500}}')
    sidecars.answer("r2", 200, TOKENS)
    pool = await _pool(sidecars, "r1", "r2")
    plan = await _plan(_api(pool), "tokenize", PROMPT)
    assert plan == Local(200, TOKENS)
    assert [host for host, *_ in sidecars.calls] == ["r1", "r2"]
    assert (_breaker(pool, 0), _breaker(pool, 1)) == (BreakerState.OPEN, BreakerState.CLOSED)


async def test_when_no_endpoint_answers_it_is_a_503_and_open_breakers_are_skipped(sidecars: Sidecars) -> None:
    sidecars.fail("r1")
    sidecars.fail("r2")
    pool = await _pool(sidecars, "r1", "r2")
    api = _api(pool)
    plan = await _plan(api, "detokenize", {"model": "tiny", "tokens": [1]})
    assert plan.status == 503 and _error(plan)["code"] == "render_unavailable"
    assert len(sidecars.calls) == 2 and _breaker(pool, 0) is _breaker(pool, 1) is BreakerState.OPEN
    again = await _plan(api, "detokenize", {"model": "tiny", "tokens": [1]})
    assert again.status == 503 and len(sidecars.calls) == 2  # both cooling down: nothing tried


async def test_an_endpoint_without_the_route_is_a_503_asked_once(sidecars: Sidecars) -> None:
    """An older render server (404 without an OpenAI error): the same on every endpoint of a
    base model, so not asked twice (as a render it does not serve)."""
    sidecars.answer("r1", 404, b'{"detail":"Not Found"}')
    sidecars.answer("r2", 404, b'{"detail":"Not Found"}')
    pool = await _pool(sidecars, "r1", "r2")
    plan = await _plan(_api(pool), "tokenize", PROMPT)
    assert plan.status == 503 and _error(plan)["code"] == "render_unavailable"
    assert len(sidecars.calls) == 1


async def test_after_its_cool_down_an_endpoint_is_probed_and_rejoins_on_an_answer(sidecars: Sidecars) -> None:
    now = [0.0]
    sidecars.fail("r1")
    pool = await _pool(sidecars, "r1", clock=lambda: now[0])
    api = _api(pool)
    assert (await _plan(api, "tokenize", PROMPT)).status == 503
    sidecars.answer("r1", 200, TOKENS)
    now[0] = 6.0  # past the 5 s cool-down
    assert await _plan(api, "tokenize", PROMPT) == Local(200, TOKENS)
    assert _breaker(pool, 0) is BreakerState.CLOSED


async def test_render_in_process_answers_through_vllms_tokenize_routes(sidecars: Sidecars) -> None:
    renderer = FakeInProcess(200, TOKENS)
    pool = RenderPool([pool_member("in_process", None, renderer, 5.0)], "tiny", 1000.0)
    api = _api(pool)
    assert await _plan(api, "tokenize", {"model": "tiny-alias", "prompt": "hi"}) == Local(200, TOKENS)
    assert renderer.asked == [("/tokenize", orjson.dumps({"model": "tiny", "prompt": "hi"}))]
    assert sidecars.calls == []


async def test_the_in_process_routes_validate_as_vllms_routes() -> None:
    """The union body of `/tokenize` takes either form; `/detokenize` wants token ids."""
    from pydantic import ValidationError

    routes = in_process_routes()
    tokenize, detokenize = (partial(as_fastapi_validates, routes[p].model()) for p in ("/tokenize", "/detokenize"))
    assert type(tokenize({"prompt": "hi"})).__name__ == "TokenizeCompletionRequest"
    chat = tokenize({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False})
    assert type(chat).__name__ == "TokenizeChatRequest" and chat.add_generation_prompt is False
    with pytest.raises(ValidationError):
        tokenize({"model": "tiny"})
    with pytest.raises(ValidationError):
        detokenize({"tokens": [-1]})
    # a model validator's vLLM error (not a ValidationError) is raised as the route's model
    # raises it; `InProcessRender` answers it with vLLM's exception handler, as the sidecar does
    both = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}
    with pytest.raises(Exception, match="Cannot set both") as raised:
        tokenize({**both, "continue_final_message": True})
    assert type(raised.value).__name__ == "VLLMValidationError"


# -- through the exchange, as Envoy drives it


async def test_through_the_exchange_render_answers_and_nothing_reaches_an_engine() -> None:
    from ext_proc.byte_budget import ByteBudget
    from ext_proc.config import TitoConfig
    from ext_proc.config_edge import PublicRoute
    from ext_proc.envoy_protocol.exchange import Exchange
    from ext_proc.fleet.http_client import CountingTransport
    from ext_proc.legs.trigger import Triggers
    from ext_proc.planning.planner import Planner
    from ext_proc.server import build_scheduler
    from ext_proc.services import Services

    class RenderOnly:
        """Tokenization whose render pool is one in-process renderer; nothing is rendered for generation."""

        def __init__(self, pool: RenderPool) -> None:
            self.pool = pool

        async def tokenize(self, *args: Any) -> Any:
            raise AssertionError("a tokenize request was rendered for generation")

    engine_calls: list[str] = []

    def engine(request: httpx.Request) -> httpx.Response:
        engine_calls.append(str(request.url))
        return httpx.Response(500)

    pools = [{"name": "union", "role": "union", "instances": [{"port": 8201}]}]
    config = TitoConfig.model_validate({"pools": pools})
    route = PublicRoute.model_construct(method="POST", path="/tokenize", handler="tokenize")  # (opt-in)
    config.listener.routes.append(route)
    renderer = FakeInProcess(200, TOKENS)
    tokenization = RenderOnly(RenderPool([pool_member("in_process", None, renderer, 5.0)], "tiny", 1000.0))
    planner = Planner(config, tokenization, build_scheduler(config))  # type: ignore[arg-type]
    http = httpx.AsyncClient(transport=httpx.MockTransport(engine))
    services = Services(
        config=config,
        tokenization=tokenization,  # type: ignore[arg-type]
        derender=None,  # type: ignore[arg-type]
        planner=planner,
        http=http,
        http_streams=CountingTransport(httpx.AsyncHTTPTransport()),
        inflight=ByteBudget(1 << 20),
        triggers=Triggers(planner, http, 5.0),
    )
    exchange = Exchange(services)
    replies = [reply async for message in _envoy("/tokenize", PROMPT) async for reply in exchange.on_message(message)]
    await exchange.aclose()
    parts = [r.streamed_immediate_response for r in replies if r.HasField("streamed_immediate_response")]
    status = {h.key: h.raw_value for h in parts[0].headers_response.headers.headers}[":status"]
    assert (int(status), parts[1].body_response.body) == (200, TOKENS)
    assert renderer.asked == [("/tokenize", orjson.dumps(PROMPT))]
    assert engine_calls == [] and not any(r.HasField("request_headers") for r in replies)  # nothing routed
    assert services.scheduler.snapshot()["active_requests"] == 0 and services.scheduler.ledger.active_leases == 0


async def _envoy(path: str, body: dict[str, Any]) -> Any:
    """The request's headers, then its whole body, as Envoy sends them to the processor."""
    from protos.stubs import core_pb, ext_proc_pb

    pairs = {":method": "POST", ":path": path, "content-type": "application/json"}
    headers = core_pb.HeaderMap(headers=[core_pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])
    yield ext_proc_pb.ProcessingRequest(request_headers=ext_proc_pb.HttpHeaders(headers=headers, end_of_stream=False))
    http_body = ext_proc_pb.HttpBody(body=orjson.dumps(body), end_of_stream=True)
    yield ext_proc_pb.ProcessingRequest(request_body=http_body)


def test_the_in_process_renderer_is_given_the_routes_client_apis_need() -> None:
    from ext_proc.api.routes import render_routes

    assert {"/tokenize", "/detokenize", "/v1/responses/render"} <= set(render_routes())
