"""The processor's per-stream state machine at its edge, driven message by message as Envoy
would (no Envoy, no render, no engine): a processor bug is a generic 500, request bodies
are bounded as they arrive, and every byte a stream holds is let go on every exit."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest

from ext_proc.byte_budget import ByteBudget
from ext_proc.config import TitoConfig
from ext_proc.envoy_protocol.exchange import Exchange, Services
from ext_proc.legs.http_client import CountingTransport
from ext_proc.server import build_scheduler
from protos.stubs import core_pb, ext_proc_pb

LIMIT = 1000


class ExplodingTokenization:
    async def tokenize(self, *args: Any) -> Any:
        raise RuntimeError("secret internal detail")


def _services(budget: int = 10 * LIMIT) -> Services:
    config = TitoConfig.model_validate({"listener": {"max_request_bytes": LIMIT}})
    return Services(
        config=config,
        tokenization=ExplodingTokenization(),  # type: ignore[arg-type]
        derender=None,  # type: ignore[arg-type]
        scheduler=build_scheduler(config),
        http=httpx.AsyncClient(),
        http_streams=CountingTransport(httpx.AsyncHTTPTransport()),
        inflight=ByteBudget(budget),
    )


def _headers(path: str = "/v1/chat/completions", method: str = "POST", **extra: str) -> ext_proc_pb.ProcessingRequest:
    pairs = {":method": method, ":path": path, "content-type": "application/json", **extra}
    headers = [core_pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    return ext_proc_pb.ProcessingRequest(
        request_headers=ext_proc_pb.HttpHeaders(headers=core_pb.HeaderMap(headers=headers), end_of_stream=method == "GET")
    )


def _body(data: bytes, end: bool) -> ext_proc_pb.ProcessingRequest:
    return ext_proc_pb.ProcessingRequest(request_body=ext_proc_pb.HttpBody(body=data, end_of_stream=end))


def _run(exchange: Exchange, *messages: ext_proc_pb.ProcessingRequest) -> list[ext_proc_pb.ProcessingResponse]:
    async def go() -> list[ext_proc_pb.ProcessingResponse]:
        return [reply for message in messages async for reply in exchange.on_message(message)]

    return asyncio.run(go())


def _immediate(replies: list[ext_proc_pb.ProcessingResponse]) -> tuple[int, dict[str, Any]]:
    [reply] = [r for r in replies if r.HasField("immediate_response")]
    answer = reply.immediate_response
    return answer.status.code, orjson.loads(answer.body)


def test_a_processor_bug_is_a_generic_500_with_the_request_id() -> None:
    services = _services()
    exchange = Exchange(services)
    chat = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    status, body = _immediate(_run(exchange, _headers(), _body(chat, True)))
    assert status == 500
    assert body["error"]["type"] == "server_error" and body["error"]["code"] == "internal_error"
    assert "secret" not in body["error"]["message"] and exchange._request_id in body["error"]["message"]
    exchange.close()
    assert services.active_exchanges == 0 and services.inflight.held == 0


def test_a_body_over_the_limit_is_answered_as_it_crosses_it() -> None:
    services = _services()
    exchange = Exchange(services)
    replies = _run(exchange, _headers(), _body(b"x" * 600, False), _body(b"x" * 600, False))
    status, body = _immediate(replies)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert services.inflight.held == 0  # let go at once, not at the end of the stream
    assert _run(exchange, _body(b"x" * 600, True)) == []  # the rest is not read
    exchange.close()


def test_a_declared_length_over_the_limit_is_answered_before_the_body() -> None:
    exchange = Exchange(_services())
    status, _ = _immediate(_run(exchange, _headers(**{"content-length": str(LIMIT + 1)})))
    assert status == 413
    exchange.close()


def test_the_inflight_budget_turns_new_bytes_away_and_comes_back() -> None:
    services = _services(budget=1000)
    first, second = Exchange(services), Exchange(services)
    assert _run(first, _headers(), _body(b"x" * 800, False)) == []
    status, body = _immediate(_run(second, _headers(), _body(b"x" * 300, False)))
    assert status == 503 and body["error"]["code"] == "overloaded"
    assert services.inflight.held == 800
    first.close()  # e.g. the client left mid-upload
    second.close()
    assert services.inflight.held == 0


@pytest.mark.parametrize(
    ("method", "path", "status"), [("POST", "/tokenize", 404), ("GET", "/health", 200), ("POST", "/health", 404)]
)
def test_only_the_route_table_is_served(method: str, path: str, status: int) -> None:
    exchange = Exchange(_services())
    assert _immediate(_run(exchange, _headers(path, method)))[0] == status
    exchange.close()


def test_passthrough_forwards_only_the_allowed_headers_and_takes_no_lease() -> None:
    services = _services()
    exchange = Exchange(services)
    steering = {"x-data-parallel-rank": "1", "x-envoy-max-retries": "7", "authorization": "Bearer k"}
    [reply] = _run(exchange, _headers("/v1/models", "GET", traceparent="00-ab-cd-01", **steering))
    removed = set(reply.request_headers.response.header_mutation.remove_headers)
    assert set(steering) <= removed and "traceparent" not in removed and "content-type" not in removed
    assert services.scheduler.ledger.active_leases == 0
    exchange.close()
