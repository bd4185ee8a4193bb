"""The processor's per-stream protocol adapter driven message by message as Envoy would,
with fake tokenization and derender and engines behind an httpx mock transport (no Envoy,
no render, no engine): every plan kind, every response handler, the edge (a processor bug
is a generic 500, bodies bounded as they arrive), and leases back to zero after each."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from ext_proc.byte_budget import ByteBudget
from ext_proc.config import TitoConfig
from ext_proc.config_edge import PublicRoute
from ext_proc.envoy_protocol.exchange import Exchange
from ext_proc.fleet.http_client import CountingTransport
from ext_proc.fleet.lora import AdapterLoader
from ext_proc.legs.trigger import Triggers
from ext_proc.planning.planner import Planner
from ext_proc.protocol import OpenAIRequest, PromptTokens, TokenizedRequest
from ext_proc.server import build_scheduler
from ext_proc.services import Services
from protos.stubs import core_pb, ext_proc_pb

LIMIT = 1000
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
UNION = [{"name": "union", "role": "union", "instances": [{"port": 8201}, {"port": 8202}]}]
PD = [
    {"name": "p", "role": "prefill", "instances": [{"port": 8301}, {"port": 8302}]},
    {"name": "d", "role": "decode", "instances": [{"port": 8401}]},
]


class FakeTokenization:
    """Render's answer without render: one GenerateRequest per prompt."""

    pool = None  # no render endpoints (Messages settings then are native's defaults)

    def __init__(self) -> None:
        self.fail = False
        self.rendered_model: str | None = None

    async def tokenize(self, request: OpenAIRequest, raw: bytes, request_id: str) -> TokenizedRequest:
        self.rendered_model = orjson.loads(raw).get("model")  # what render was asked for
        if self.fail:
            raise RuntimeError("secret internal detail")
        prompts = request.body.get("prompt", ["chat"])
        prompts = prompts if isinstance(prompts, list) else [prompts]
        rendered = [
            {
                "request_id": "chatcmpl-" + request_id,
                "token_ids": [1, 2, 3, i + 4],
                "sampling_params": {"max_tokens": request.body.get("max_tokens", 16), "min_tokens": 1, "n": request.n},
                "stream": request.stream,
            }
            for i in range(len(prompts))
        ]
        return TokenizedRequest(request, "chatcmpl-" + request_id, [PromptTokens.rendered(r) for r in rendered])


class FakeSession:
    completion_tokens = 0

    async def steps(self, events: list[tuple[dict[str, Any], bytes]]) -> bytes:
        return b"".join(b"data: " + orjson.dumps({"ids": e["choices"][0]["token_ids"]}) + b"\n\n" for e, _ in events)


class FakeDerender:
    def stream(self, request: TokenizedRequest, prompt_index: int = 0) -> FakeSession:
        return FakeSession()

    async def whole(self, request: TokenizedRequest, generate_body: bytes, prompt_index: int = 0) -> bytes:
        ids = orjson.loads(generate_body)["choices"][0]["token_ids"]
        usage = {"prompt_tokens": 4, "total_tokens": 4 + len(ids), "completion_tokens": len(ids)}
        return orjson.dumps({"choices": [{"index": 0, "ids": ids}], "usage": usage})


class Engines:
    """Every engine's HTTP side (prefill legs, native replays): scripted per host."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.answer: Callable[[str, dict[str, Any]], httpx.Response] = self.prefill_ok

    @staticmethod
    def prefill_ok(host: str, body: dict[str, Any]) -> httpx.Response:
        params = {"do_remote_prefill": True, "remote_engine_id": host}
        return httpx.Response(200, json={"choices": [{"token_ids": [9]}], "kv_transfer_params": params})

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        self.calls.append((f"{request.url.host}:{request.url.port}{request.url.path}", body))
        return self.answer(f"{request.url.host}:{request.url.port}", body)


@pytest.fixture
def engines() -> Engines:
    return Engines()


def _services(
    engines: Engines, pools: list[dict[str, Any]] = UNION, budget: int = 10 * LIMIT, **sections: Any
) -> Services:
    config = TitoConfig.model_validate({"listener": {"max_request_bytes": LIMIT}, "pools": pools, **sections})
    http = httpx.AsyncClient(transport=httpx.MockTransport(engines.handle))
    tokenization = FakeTokenization()
    planner = Planner(config, tokenization, build_scheduler(config))  # type: ignore[arg-type]
    return Services(
        config=config,
        tokenization=tokenization,  # type: ignore[arg-type]
        derender=FakeDerender(),
        planner=planner,
        http=http,
        http_streams=CountingTransport(httpx.AsyncHTTPTransport()),
        inflight=ByteBudget(budget),
        triggers=Triggers(planner, http, 5.0),
    )


def _headers(path: str = "/v1/chat/completions", method: str = "POST", end: bool = False, **extra: str) -> Any:
    pairs = {":method": method, ":path": path, "content-type": "application/json", **extra}
    headers = core_pb.HeaderMap(headers=[core_pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])
    return ext_proc_pb.ProcessingRequest(request_headers=ext_proc_pb.HttpHeaders(headers=headers, end_of_stream=end))


def _body(data: bytes | dict[str, Any], end: bool = True) -> Any:
    raw = data if isinstance(data, bytes) else orjson.dumps(data)
    return ext_proc_pb.ProcessingRequest(request_body=ext_proc_pb.HttpBody(body=raw, end_of_stream=end))


def _response_headers(status: int, content_type: str, end: bool = False, **extra: str) -> Any:
    pairs = {":status": str(status), "content-type": content_type, **extra}
    headers = core_pb.HeaderMap(headers=[core_pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])
    return ext_proc_pb.ProcessingRequest(response_headers=ext_proc_pb.HttpHeaders(headers=headers, end_of_stream=end))


def _response_body(data: bytes, end: bool) -> Any:
    return ext_proc_pb.ProcessingRequest(response_body=ext_proc_pb.HttpBody(body=data, end_of_stream=end))


async def _run(exchange: Exchange, *messages: Any) -> list[Any]:
    return [reply for message in messages async for reply in exchange.on_message(message)]


def _immediate(replies: list[Any]) -> tuple[int, dict[str, Any]]:
    [reply] = [r for r in replies if r.HasField("immediate_response")]
    return reply.immediate_response.status.code, orjson.loads(reply.immediate_response.body)


def _local(replies: list[Any]) -> tuple[int, dict[str, Any]]:
    """The processor's own answer: a refusal is an ImmediateResponse (the EPP protocol's 503
    and 429 are), any other a streamed one."""
    refused = [r.immediate_response for r in replies if r.HasField("immediate_response")]
    if refused:
        return refused[0].status.code, orjson.loads(refused[0].body)
    parts = [r.streamed_immediate_response for r in replies if r.HasField("streamed_immediate_response")]
    status = {h.key: h.raw_value for h in parts[0].headers_response.headers.headers}[":status"]
    return int(status), orjson.loads(parts[1].body_response.body)


def _routed(replies: list[Any]) -> tuple[dict[str, str], str, dict[str, Any]]:
    """The request-headers reply (set headers, destination) and the new body."""
    headers = replies[0].request_headers.response.header_mutation
    destination = replies[0].dynamic_metadata["envoy.lb"]["x-gateway-destination-endpoint"]
    body = b"".join(r.request_body.response.body_mutation.streamed_response.body for r in replies[1:])
    return {h.header.key: h.header.raw_value.decode() for h in headers.set_headers}, destination, orjson.loads(body)


def _client_body(replies: list[Any]) -> bytes:
    return b"".join(
        r.response_body.response.body_mutation.streamed_response.body for r in replies if r.HasField("response_body")
    )


async def _closed(services: Services, *exchanges: Exchange) -> dict[str, Any]:
    for exchange in exchanges:
        await exchange.aclose()
    assert services.process.active_exchanges == 0 and services.inflight.held == 0
    state: dict[str, Any] = services.scheduler.snapshot()
    assert state["total_active_tokens"] == 0 and state["active_requests"] == 0
    return state


# -- plan kinds ----------------------------------------------------------------------------


async def test_local_plan_answers_a_bad_request(engines: Engines) -> None:
    services = _services(engines)
    exchange = Exchange(services)
    status, body = _local(await _run(exchange, _headers(), _body(b'{"model": "tiny", "messages": [')))
    assert status == 400 and body["error"]["type"] == "Bad Request" and body["error"]["param"] == "body.31"  # native's
    await _closed(services, exchange)


async def test_passthrough_plan_takes_no_lease_and_forwards_only_allowed_headers(engines: Engines) -> None:
    services = _services(engines)
    exchange = Exchange(services)
    steering = {"x-data-parallel-rank": "1", "x-envoy-max-retries": "7", "authorization": "Bearer k"}
    services.config.listener.routes.append(PublicRoute(method="GET", path="/version", handler="passthrough"))
    [reply] = await _run(exchange, _headers("/version", "GET", end=True, traceparent="00-ab-cd-01", **steering))
    removed = set(reply.request_headers.response.header_mutation.remove_headers)
    assert set(steering) <= removed and "traceparent" not in removed
    assert services.scheduler.ledger.active_leases == 0
    # The call stays open: the engine's answer streams through unchanged (FULL_DUPLEX)
    assert not exchange.answered
    answer = await _run(exchange, _response_headers(500, "application/json"), _response_body(b'{"a": 1}', True))
    assert _client_body(answer) == b'{"a": 1}'
    state = await _closed(services, exchange)
    assert all(i["breaker"] == "closed" and i["consecutive_failures"] == 0 for i in state["instances"].values())


async def test_a_passthrough_post_forwards_its_body_unchanged(engines: Engines) -> None:
    services = _services(engines)
    exchange = Exchange(services)
    route = {"method": "POST", "path": "/v1/audio/transcriptions", "handler": "passthrough"}
    services.config.listener.routes.append(PublicRoute.model_validate(route))
    [headers_reply] = await _run(exchange, _headers("/v1/audio/transcriptions", "POST"))
    assert headers_reply.HasField("request_headers") and not exchange.answered
    first = await _run(exchange, _body(b'{"model": ', end=False))
    assert first[0].request_body.response.body_mutation.streamed_response.body == b'{"model": '
    assert not exchange.answered
    last = await _run(exchange, _body(b'"tiny"}'))
    assert last[0].request_body.response.body_mutation.streamed_response.end_of_stream
    assert not exchange.answered  # the engine's answer comes through here
    await _closed(services, exchange)


def _generate(host: str, body: dict[str, Any]) -> httpx.Response:
    """A token-only engine: the prompt's last id back, streamed or whole."""
    ids = [body["token_ids"][-1] * 10]
    if not body.get("stream"):
        answer = orjson.dumps({"choices": [{"index": 0, "token_ids": ids, "finish_reason": "length"}]})
        return httpx.Response(200, headers={"content-type": "application/json"}, stream=httpx.ByteStream(answer))
    events = [{"choices": [{"index": 0, "token_ids": ids}]}, {"choices": [], "usage": {"completion_tokens": 1}}]
    sse = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=httpx.ByteStream(sse))


async def test_a_multi_prompt_batch_fans_out_one_leg_per_prompt(engines: Engines) -> None:
    services = _services(engines)
    engines.answer = _generate
    exchange = Exchange(services)
    batch = {"model": "tiny", "prompt": ["a", "b", "c"], "max_tokens": 3, "priority": 9}
    replies = await _run(exchange, _headers("/v1/completions"), _body(batch))
    status, answer = _local(replies)
    assert status == 200 and exchange.answered
    assert answer["choices"] == [{"index": 0, "ids": [40]}, {"index": 1, "ids": [50]}, {"index": 2, "ids": [60]}]
    assert answer["usage"] == {"prompt_tokens": 12, "total_tokens": 15, "completion_tokens": 3}
    calls = sorted((body["token_ids"], body["request_id"], path) for path, body in engines.calls)
    assert [ids for ids, _, _ in calls] == [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 6]]
    assert len({rid for _, rid, _ in calls}) == 3 and all(p.endswith("/inference/v1/generate") for *_, p in calls)
    await _closed(services, exchange)


class _CutStream(httpx.AsyncByteStream):
    """An engine answer whose connection drops after its first bytes."""

    async def __aiter__(self) -> Any:
        yield b'{"choices": ['
        raise httpx.RemoteProtocolError("peer closed connection")


async def test_a_batch_whose_engine_fails_mid_answer_is_a_502_and_gives_everything_back(engines: Engines) -> None:
    services = _services(engines)
    engines.answer = lambda host, body: (
        httpx.Response(200, stream=_CutStream()) if body["token_ids"][-1] == 5 else _generate(host, body)
    )
    exchange = Exchange(services)
    batch = {"model": "tiny", "prompt": ["a", "b", "c"], "max_tokens": 3}
    status, error = _local(await _run(exchange, _headers("/v1/completions"), _body(batch)))
    assert status == 502 and error["error"]["code"] == "engine_stream_failed"
    await _closed(services, exchange)


async def test_a_multi_prompt_stream_is_one_merged_sse_stream(engines: Engines) -> None:
    services = _services(engines)
    engines.answer = _generate
    exchange = Exchange(services)
    batch = {"model": "tiny", "prompt": ["a", "b"], "max_tokens": 3, "stream": True}
    outbox = _start(exchange, _headers("/v1/completions"), _body({**batch, "stream_options": {"include_usage": True}}))
    replies = await _drain(exchange, outbox)
    parts = [r.streamed_immediate_response for r in replies]
    assert {h.key: h.raw_value for h in parts[0].headers_response.headers.headers}[":status"] == b"200"
    body = b"".join(p.body_response.body for p in parts[1:])
    assert parts[-1].body_response.end_of_stream and body.count(b"data: [DONE]") == 1 and body.endswith(b"[DONE]\n\n")
    assert b'data: {"ids":[40]}' in body and b'data: {"ids":[50]}' in body
    usage = orjson.loads(body.split(b"data: ")[-2])["usage"]
    assert usage == {"prompt_tokens": 8, "total_tokens": 10, "completion_tokens": 2}
    await _closed(services, exchange)


async def test_a_batch_is_admitted_as_the_sum_of_its_prompts(engines: Engines) -> None:
    services = _services(engines, budget=10 * LIMIT)
    services.scheduler.ledger.global_budget = 2 * (4 + 3)  # two prompts fit, three do not
    engines.answer = _generate
    exchange = Exchange(services)
    batch = {"model": "tiny", "prompt": ["a", "b", "c"], "max_tokens": 3}
    status, error = _local(await _run(exchange, _headers("/v1/completions"), _body(batch)))
    assert status == 429 and error["error"]["code"] == "token_budget_exceeded" and not engines.calls
    await _closed(services, exchange)


async def test_token_only_plan_streams_through_derender(engines: Engines) -> None:
    services = _services(engines)
    exchange = Exchange(services)
    replies = await _run(exchange, _headers(), _body({**CHAT, "stream": True}))
    set_headers, destination, body = _routed(replies)
    assert set_headers[":path"] == "/inference/v1/generate"
    assert set_headers["x-envoy-max-retries"] == "1"  # only the other listed instance
    assert set_headers["x-request-id"] == "chatcmpl-" + exchange.request_id == body["request_id"]
    assert body["token_ids"] == [1, 2, 3, 4] and body["sampling_params"]["max_tokens"] == 4
    assert services.scheduler.ledger.total_tokens == 4 + 4
    event = b'data: {"choices":[{"index":0,"token_ids":[7]}]}\n\n'
    upstream = "127.0.0.1:8201"
    replies = await _run(
        exchange,
        _response_headers(200, "text/event-stream", **{"x-tito-upstream-host": upstream}),
        _response_body(event[:10], False),
        _response_body(event[10:] + b"data: [DONE]\n\n", True),
    )
    assert _client_body(replies) == b'data: {"ids":[7]}\n\ndata: [DONE]\n\n'
    state = await _closed(services, exchange)
    assert state["instances"][upstream]["breaker"] == "closed"


async def test_buffered_response_is_derendered_once_and_engine_errors_become_openai_errors(engines: Engines) -> None:
    services = _services(engines)
    ok, failed = Exchange(services), Exchange(services)
    for exchange in (ok, failed):
        await _run(exchange, _headers(), _body(CHAT))
    replies = await _run(
        ok, _response_headers(200, "application/json"), _response_body(b'{"choices":[{"token_ids":[5,6]}]}', True)
    )
    assert orjson.loads(_client_body(replies))["choices"] == [{"index": 0, "ids": [5, 6]}]
    replies = await _run(
        failed,
        _response_headers(500, "text/plain", **{"x-tito-upstream-host": "127.0.0.1:8201"}),
        _response_body(b"boom", True),
    )
    assert replies[0].response_headers.response.header_mutation.set_headers[0].header.raw_value == b"500"
    assert orjson.loads(_client_body(replies))["error"]["message"] == "boom"
    state = await _closed(services, ok, failed)
    assert state["instances"]["127.0.0.1:8201"]["consecutive_failures"] == 1  # the routed leg's verdict


async def test_an_engine_without_token_only_generate_gets_a_native_replay(engines: Engines) -> None:
    services = _services(engines)
    engines.answer = lambda host, body: httpx.Response(
        200, headers={"content-type": "application/json"}, stream=httpx.ByteStream(orjson.dumps({"native": host}))
    )
    exchange = Exchange(services)
    await _run(exchange, _headers(), _body(CHAT))
    replies = await _run(
        exchange, _response_headers(404, "application/json"), _response_body(b'{"detail":"Not Found"}', True)
    )
    assert orjson.loads(_client_body(replies)) == {"native": "127.0.0.1:8201"}
    assert engines.calls[0][0] == "127.0.0.1:8201/v1/chat/completions" and engines.calls[0][1] == CHAT
    assert services.scheduler.supports_token_only("127.0.0.1:8201") is False
    await _closed(services, exchange)


async def test_a_buffered_response_over_the_cap_is_a_502(engines: Engines) -> None:
    services = _services(engines)
    services.config.processor.max_response_bytes = 10
    exchange = Exchange(services)
    await _run(exchange, _headers(), _body(CHAT))
    replies = await _run(exchange, _response_headers(200, "application/json"), _response_body(b"x" * 11, False))
    assert _immediate(replies)[0] == 502
    assert await _run(exchange, _response_body(b"x", True)) == []  # the rest is dropped
    await _closed(services, exchange)


# -- prefill/decode ------------------------------------------------------------------------


async def test_handoff_runs_prefill_then_routes_decode_with_its_params(engines: Engines) -> None:
    services = _services(engines, PD)
    exchange = Exchange(services)
    replies = await _run(exchange, _headers(), _body({**CHAT, "stream": True}))
    [(target, prefill)] = engines.calls
    assert target.endswith("/inference/v1/generate") and target.startswith("127.0.0.1:830")
    assert prefill["stream"] is False and prefill["sampling_params"]["max_tokens"] == 1
    assert "min_tokens" not in prefill["sampling_params"]
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    set_headers, destination, decode = _routed(replies)
    assert destination == "127.0.0.1:8401" and set_headers["x-envoy-max-retries"] == "0"
    assert set_headers["x-request-id"] == f"chatcmpl-{exchange.request_id}-decode" == decode["request_id"]
    params = {"do_remote_prefill": True, "remote_engine_id": target.split("/")[0]}
    assert decode["kv_transfer_params"] == params and decode["sampling_params"]["extra_args"] == {
        "kv_transfer_params": params
    }
    assert decode["stream"] is True and decode["sampling_params"]["max_tokens"] == 4
    # prefill's tokens went back when it finished; decode holds its own
    assert services.scheduler.ledger.total_tokens == 4
    await _closed(services, exchange)


async def test_a_failed_prefill_is_retried_on_the_other_instance_and_counted(engines: Engines) -> None:
    services = _services(engines, PD)
    first: list[str] = []

    def flaky(host: str, body: dict[str, Any]) -> httpx.Response:
        first.append(host)
        return httpx.Response(500, text="down") if len(first) == 1 else Engines.prefill_ok(host, body)

    engines.answer = flaky
    exchange = Exchange(services)
    _, destination, decode = _routed(await _run(exchange, _headers(), _body(CHAT)))
    assert len(set(first)) == 2 and destination == "127.0.0.1:8401"
    assert decode["kv_transfer_params"]["remote_engine_id"] == first[1]
    state = await _closed(services, exchange)
    assert state["instances"][first[0]]["consecutive_failures"] == 1


async def test_no_prefill_anywhere_is_a_503_and_no_decode_call(engines: Engines) -> None:
    services = _services(engines, PD)
    engines.answer = lambda host, body: httpx.Response(503, text="down")
    exchange = Exchange(services)
    status, body = _local(await _run(exchange, _headers(), _body(CHAT)))
    assert status == 503 and body["error"]["code"] == "prefill_failed"
    assert len(engines.calls) == 2  # both prefill instances, nothing to decode
    await _closed(services, exchange)


async def test_when_every_prefill_fails_a_union_instance_serves_it(engines: Engines) -> None:
    services = _services(engines, [*PD, {"name": "u", "role": "union", "instances": [{"port": 8501}]}])
    engines.answer = lambda host, body: httpx.Response(503, text="down")
    exchange = Exchange(services)
    set_headers, destination, body = _routed(await _run(exchange, _headers(), _body(CHAT)))
    assert destination == "127.0.0.1:8501" and "kv_transfer_params" not in body
    assert len(engines.calls) == 2 and services.scheduler.ledger.total_tokens == 4 + 4
    state = await _closed(services, exchange)
    assert [state["instances"][f"127.0.0.1:{p}"]["consecutive_failures"] for p in (8301, 8302, 8401)] == [1, 1, 0]


async def test_pd_hybrid_serves_alone_on_a_colocated_decode_when_prefill_is_down(engines: Engines) -> None:
    pools = [
        PD[0],
        {**PD[1], "instances": [{"port": 8401, "capabilities": ["prefill_handoff_decode", "decode_colocation"]}]},
    ]
    services = _services(engines, pools)
    for address in ("127.0.0.1:8301", "127.0.0.1:8302"):
        for _ in range(3):
            services.scheduler.breakers[address].record_failure(time.monotonic())
    exchange = Exchange(services)
    set_headers, destination, body = _routed(await _run(exchange, _headers(), _body(CHAT)))
    assert destination == "127.0.0.1:8401" and "kv_transfer_params" not in body and engines.calls == []
    await _closed(services, exchange)


TRIGGER = [PD[0], {**PD[1], "instances": [{"port": 8401, "capabilities": ["concurrent_engine_sync"]}]}]


async def test_trigger_sends_decode_first_and_prefill_on_the_engines_callback(engines: Engines) -> None:
    services = _services(engines, TRIGGER)
    exchange = Exchange(services)
    outbox = _start(exchange, _headers(), _body({**CHAT, "stream": True}))
    replies = [await outbox.replies.get() for _ in range(2)]
    set_headers, destination, decode = _routed(replies)
    assert destination == "127.0.0.1:8401" and engines.calls == []  # decode first
    params = decode["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    metaserver, attempt = params["metaserver"].split("?attempt=")
    assert metaserver == "http://127.0.0.1:9003/v1/metaserver" and attempt == "0"
    engine_id = "generate-tokens-" + set_headers["x-request-id"]
    call = orjson.dumps({"request_id": engine_id, "kv_transfer_params": {**params, "remote_port": 5}})
    assert (await services.triggers.callback("1", call))[0] == 409  # stale attempt
    assert (await services.triggers.callback("0", orjson.dumps({"request_id": "nope"})))[0] == 404
    assert await services.triggers.callback("0", call) == (200, {"status": "ok"})
    [(target, prefill)] = engines.calls
    assert target.startswith("127.0.0.1:830") and target.endswith("/inference/v1/generate")
    assert prefill["kv_transfer_params"] == {"do_remote_prefill": False, "do_remote_decode": True, "remote_port": 5}
    assert prefill["sampling_params"]["max_tokens"] == 1 and prefill["sampling_params"]["min_tokens"] == 1
    assert prefill["stream"] is False
    assert (await services.triggers.callback("0", call))[0] == 409  # prefill already sent
    assert services.scheduler.ledger.active_leases == 2  # prefill held until decode's first chunk
    await _run(exchange, _response_headers(200, "text/event-stream"), _response_body(b"data: [DONE]\n\n", True))
    assert services.scheduler.ledger.active_leases == 1
    await _closed(services, exchange)
    assert len(services.triggers) == 0


# -- the edge ------------------------------------------------------------------------------


async def test_a_processor_bug_is_a_generic_500_with_the_request_id(engines: Engines) -> None:
    services = _services(engines)
    services.tokenization.fail = True  # type: ignore[attr-defined]
    exchange = Exchange(services)
    replies = await _drain(exchange, _start(exchange, _headers(), _body(CHAT)))
    status, body = _immediate(replies)
    assert status == 500 and body["error"]["code"] == "internal_error"
    assert "secret" not in body["error"]["message"] and exchange.request_id in body["error"]["message"]
    await _closed(services, exchange)


async def test_a_body_over_the_limit_is_answered_as_it_crosses_it(engines: Engines) -> None:
    services = _services(engines)
    exchange = Exchange(services)
    replies = await _run(exchange, _headers(), _body(b"x" * 600, False), _body(b"x" * 600, False))
    assert _immediate(replies)[0] == 413
    assert services.inflight.held == 0  # let go at once
    assert await _run(exchange, _body(b"x" * 600, True)) == []  # the rest is not read
    declared = Exchange(services)
    assert _immediate(await _run(declared, _headers(**{"content-length": str(LIMIT + 1)})))[0] == 413
    await _closed(services, exchange, declared)


async def test_the_inflight_budget_turns_new_bytes_away_and_comes_back(engines: Engines) -> None:
    services = _services(engines, budget=1000)
    first, second = Exchange(services), Exchange(services)
    assert await _run(first, _headers(), _body(b"x" * 800, False)) == []
    status, body = _immediate(await _run(second, _headers(), _body(b"x" * 300, False)))
    assert status == 503 and body["error"]["code"] == "overloaded"
    await _closed(services, first, second)  # e.g. the client left mid-upload


@pytest.mark.parametrize(("method", "path", "status"), [("POST", "/tokenize", 404), ("GET", "/health", 200)])
async def test_only_the_route_table_is_served(engines: Engines, method: str, path: str, status: int) -> None:
    services = _services(engines)
    exchange = Exchange(services)
    assert _immediate(await _run(exchange, _headers(path, method, end=True)))[0] == status
    await _closed(services, exchange)


async def _messages(*messages: Any) -> Any:
    for message in messages:
        yield message


class _Outbox:
    """The gRPC server's side of a stream: the replies, as they are put."""

    def __init__(self) -> None:
        self.replies: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, reply: Any) -> None:
        self.replies.put_nowait(reply)

    async def flush(self) -> None:
        pass


def _start(exchange: Exchange, *messages: Any) -> _Outbox:
    outbox = _Outbox()
    exchange.start(_messages(*messages), outbox)
    return outbox


async def _drain(exchange: Exchange, outbox: _Outbox) -> list[Any]:
    """Every reply until the stream says the call may end."""
    await exchange.done
    return [outbox.replies.get_nowait() for _ in range(outbox.replies.qsize())]


# -- the model catalog and LoRA adapters ----------------------------------------------------------

CATALOG = {"adapters": [{"name": "sql", "path": "/adapters/sql"}], "aliases": ["tiny-latest"]}


def _lora_services(engines: Engines, on_missing: str) -> Services:
    services = _services(engines, model=CATALOG, lora={"on_missing": on_missing})
    if on_missing == "load":
        services.planner.load_adapter = AdapterLoader(services.http, services.scheduler, 5.0).load
    return services


async def test_models_is_answered_from_the_catalog(engines: Engines) -> None:
    services = _services(engines, model=CATALOG)
    exchange = Exchange(services)
    status, body = _immediate(await _run(exchange, _headers("/v1/models", "GET", end=True)))
    assert status == 200 and [(m["id"], m["parent"]) for m in body["data"]] == [
        ("tiny", None),
        ("tiny-latest", None),
        ("sql", "tiny"),
    ]
    assert engines.calls == []
    await _closed(services, exchange)


async def test_an_adapter_is_rendered_as_its_base_and_generated_under_its_own_name(engines: Engines) -> None:
    services = _lora_services(engines, "reject")
    services.scheduler.lora.set_registered("127.0.0.1:8202", ["sql"])
    exchange = Exchange(services)
    replies = await _run(exchange, _headers(), _body({**CHAT, "model": "sql"}))
    _, destination, body = _routed(replies)
    assert services.tokenization.rendered_model == "tiny"  # type: ignore[attr-defined]
    assert destination == "127.0.0.1:8202" and body["model"] == "sql"  # the only instance that lists it
    assert services.scheduler.lora.running("127.0.0.1:8202") == {"sql": 1}
    await _closed(services, exchange)
    assert services.scheduler.lora.running("127.0.0.1:8202") == {}


async def test_an_alias_is_the_base_and_an_unknown_model_gets_native_vllms_404(engines: Engines) -> None:
    services = _lora_services(engines, "reject")
    alias = Exchange(services)
    _, _, body = _routed(await _run(alias, _headers(), _body({**CHAT, "model": "tiny-latest"})))
    assert services.tokenization.rendered_model == "tiny" and "model" not in body  # type: ignore[attr-defined]
    unknown = Exchange(services)
    status, error = _local(await _run(unknown, _headers(), _body({**CHAT, "model": "gpt-5"})))
    message = "The model `gpt-5` does not exist. Valid aliases: tiny, tiny-latest."
    assert (status, error) == (
        404,
        {"error": {"message": message, "type": "NotFoundError", "param": "model", "code": 404}},
    )
    await _closed(services, alias, unknown)


async def test_on_missing_reject_refuses_an_adapter_no_instance_lists(engines: Engines) -> None:
    services = _lora_services(engines, "reject")
    exchange = Exchange(services)
    status, error = _local(await _run(exchange, _headers(), _body({**CHAT, "model": "sql"})))
    assert status == 404 and error["error"]["message"].startswith("The model `sql` does not exist.")
    assert engines.calls == []
    await _closed(services, exchange)


async def test_on_missing_load_loads_once_on_the_chosen_instance_then_routes_there(engines: Engines) -> None:
    services = _lora_services(engines, "load")
    engines.answer = lambda host, body: httpx.Response(200, text="Success")
    first, second = Exchange(services), Exchange(services)
    _, destination, body = _routed(await _run(first, _headers(), _body({**CHAT, "model": "sql"})))
    _, again, _ = _routed(await _run(second, _headers(), _body({**CHAT, "model": "sql"})))
    chosen = destination  # no fallback: no other instance has the adapter
    load = {"lora_name": "sql", "lora_path": "/adapters/sql"}
    assert engines.calls == [(f"{chosen}/v1/load_lora_adapter", load)]
    assert again == chosen and body["model"] == "sql"  # where it now runs (the only one listing it)
    await _closed(services, first, second)


async def test_a_failed_load_answers_the_engines_error_and_gives_the_lease_back(engines: Engines) -> None:
    services = _lora_services(engines, "load")
    error = {"error": {"message": "adapter not found", "type": "NotFoundError", "param": None, "code": 404}}
    engines.answer = lambda host, body: httpx.Response(404, json=error)
    exchange = Exchange(services)
    assert _local(await _run(exchange, _headers(), _body({**CHAT, "model": "sql"}))) == (404, error)
    await _closed(services, exchange)  # no lease left behind


# -- several base models --------------------------------------------------------------------------


def _two_bases(engines: Engines) -> tuple[Services, Services]:
    """A catalog of two base models (the second: `tiny-b` on its own engine), as the server
    builds it: each base its own tokenization, planner and scheduler, one process state."""
    second_base = {"model": {"served_name": "tiny-b"}, "pools": [{"instances": [{"port": 8301}]}]}
    first = _services(engines, models=[second_base])
    config = first.config.bases()[1]
    tokenization = FakeTokenization()
    planner = Planner(config, tokenization, build_scheduler(config))  # type: ignore[arg-type]
    second = Services(
        config=config,
        tokenization=tokenization,  # type: ignore[arg-type]
        derender=FakeDerender(),
        planner=planner,
        http=first.http,
        http_streams=first.http_streams,
        inflight=first.inflight,
        triggers=Triggers(planner, first.http, 5.0),
        process=first.process,
    )
    first.process.bases.append(second)
    return first, second


async def test_a_requests_model_picks_its_base_models_render_and_engines(engines: Engines) -> None:
    first, second = _two_bases(engines)
    to_b, to_first, unnamed = Exchange(first), Exchange(first), Exchange(first)
    _, destination, body = _routed(await _run(to_b, _headers(), _body({**CHAT, "model": "tiny-b"})))
    assert destination == "127.0.0.1:8301" and "model" not in body  # the base itself: render's metadata
    assert second.tokenization.rendered_model == "tiny-b"  # type: ignore[attr-defined]
    assert first.tokenization.rendered_model is None  # type: ignore[attr-defined]
    _, destination, _ = _routed(await _run(to_first, _headers(), _body(CHAT)))
    assert destination.split(",")[0] in ("127.0.0.1:8201", "127.0.0.1:8202")
    _, destination, _ = _routed(await _run(unnamed, _headers(), _body({k: v for k, v in CHAT.items() if k != "model"})))
    assert destination.split(",")[0] != "127.0.0.1:8301"  # no model: the first base
    assert second.scheduler.ledger.active_leases == 1 and first.scheduler.ledger.active_leases == 2
    await _closed(first, to_b, to_first, unnamed)
    assert second.scheduler.ledger.active_leases == 0


async def test_models_and_the_404_name_every_base(engines: Engines) -> None:
    first, _ = _two_bases(engines)
    models, unknown = Exchange(first), Exchange(first)
    status, body = _immediate(await _run(models, _headers("/v1/models", "GET", end=True)))
    assert status == 200 and [m["id"] for m in body["data"]] == ["tiny", "tiny-b"]
    status, error = _local(await _run(unknown, _headers(), _body({**CHAT, "model": "gpt-5"})))
    assert (status, error["error"]["message"]) == (
        404,
        "The model `gpt-5` does not exist. Valid aliases: tiny, tiny-b.",
    )
    await _closed(first, models, unknown)
