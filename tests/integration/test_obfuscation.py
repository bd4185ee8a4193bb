"""Token obfuscation through real Envoy and the real render sidecar, over an engine simulator
serving "obfuscated weights": it de-permutes the ids it gets and permutes the ids it emits
with the same secret, so the client sees the text of a plain gateway over a plain engine
only if the gateway obfuscates every id it sends and deobfuscates every id it receives.
And it fails closed: render down or an engine without token-only generate is a 503, never
the local tokenizer or the native path (both would hand the engine plaintext)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from ext_proc.obfuscation import KeyedPermutation, added_token_ids, vocab_size_of
from tests.conftest import RunningStack, SimGateway, start_sim_gateway
from tests.engine_sim import Fault
from tests.render_proxy import RenderFault, RenderProxy, RenderProxyServer
from tests.servers import ThreadedServer

# Its last word is not hex: request ids are random hex and could contain a hex word by chance.
SECRET = "correct horse battery staple q7zx"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Say something, 東京 🐉"}], "max_tokens": 12}
COMPLETION = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 12, "logprobs": 2}
MESSAGES = {"model": "tiny", "messages": [{"role": "user", "content": "Say something, 東京 🐉"}], "max_tokens": 12}
RESPONSES = {"model": "tiny", "input": "Say something, 東京 🐉", "max_output_tokens": 12}
CASES = {
    "chat": ("/v1/chat/completions", CHAT),
    "chat-stream": ("/v1/chat/completions", {**CHAT, "stream": True, "logprobs": True, "top_logprobs": 2}),
    "completions": ("/v1/completions", COMPLETION),
    "completions-stream": ("/v1/completions", {**COMPLETION, "stream": True}),
    "batch": ("/v1/completions", {**COMPLETION, "prompt": ["one", "two two"]}),
    # the prompt's logprobs come back keyed by physical ids, in whole answers only
    "echo": ("/v1/completions", {**COMPLETION, "echo": True, "max_tokens": 0}),
    "echo-stream": ("/v1/completions", {**COMPLETION, "echo": True, "stream": True}),
    "prompt-logprobs": ("/v1/chat/completions", {**CHAT, "prompt_logprobs": 2}),
    # Anthropic Messages are chat inside the gateway: obfuscated as chat is
    "messages": ("/v1/messages", MESSAGES),
    "messages-stream": ("/v1/messages", {**MESSAGES, "stream": True}),
    # OpenAI Responses are rendered as such and are completions inside: obfuscated as those are
    "responses": ("/v1/responses", RESPONSES),
    "responses-stream": ("/v1/responses", {**RESPONSES, "stream": True}),
}


class Pair:
    """The same simulators behind two gateways: one plain, one obfuscating (its render
    behind a fault proxy)."""

    def __init__(self, stack: RunningStack, tmp: Path) -> None:
        secret_file = tmp / "secret"
        secret_file.write_text(SECRET + "\n")
        model = Path(stack.model_path)
        self.permutation = KeyedPermutation(vocab_size_of(model), added_token_ids(model), SECRET.encode())
        self.proxy = RenderProxy(stack.config.render_config.endpoint.url)
        self.proxy_server: ThreadedServer = RenderProxyServer(self.proxy).start()
        self.servers: list[ThreadedServer] = []
        self.plain, servers = start_sim_gateway(stack, tmp / "plain", 1)
        self.servers += servers
        routes = [
            {"method": "POST", "path": "/v1/chat/completions", "handler": "chat"},
            {"method": "POST", "path": "/v1/completions", "handler": "completions"},
            {"method": "POST", "path": "/v1/messages", "handler": "messages"},
            {"method": "POST", "path": "/v1/responses", "handler": "responses"},
            {"method": "POST", "path": "/v1/embeddings", "handler": "passthrough"},
            {"method": "GET", "path": "/v1/models", "handler": "passthrough"},
        ]
        self.obfuscated, servers = start_sim_gateway(
            stack,
            tmp / "obfuscated",
            1,
            render_port=self.proxy_server.port,
            listener={"routes": routes},
            obfuscation={"enable": True, "secret_file": str(secret_file)},
            render_config={"breaker_cooldown_s": 0.0},
        )
        self.servers += servers
        self.obfuscated.sims[0].obfuscation = self.permutation

    def stop(self) -> None:
        for gateway in (self.plain, self.obfuscated):
            gateway.gateway.stop()
        for server in [*self.servers, self.proxy_server]:
            server.stop()


@pytest.fixture(scope="module")
def pair(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    started = Pair(stack, tmp_path_factory.mktemp("obfuscation"))
    yield started
    started.stop()


@pytest.fixture
def gw(pair: Pair) -> Iterator[Pair]:
    for gateway in (pair.plain, pair.obfuscated):
        gateway.restore()
    pair.proxy.faults.clear()
    yield pair
    pair.obfuscated.assert_no_leaks()
    pair.proxy.faults.clear()


def _post(gateway: SimGateway, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gateway.base_url + path, json=body, timeout=30, trust_env=False)


def _visible(response: httpx.Response) -> Any:
    """What the client sees, less what differs between any two answers (ids, times, and how a
    stream's text is cut into chunks, which follows timing)."""
    assert response.status_code == 200, response.text
    if not response.headers["content-type"].startswith("text/event-stream"):
        answer = response.json()
        answer.pop("id"), answer.pop("created", None), answer.pop("created_at", None)
        for block in answer.get("content") or []:  # Messages: thinking signatures are random
            block.pop("signature", None)
        for item in answer.get("output") or []:  # Responses: item ids are random
            item.pop("id", None)
        return answer
    if response.text.startswith("event: response."):  # OpenAI Responses events
        return _visible_responses(response.text)
    if response.text.startswith("event:"):  # Anthropic Messages events
        return _visible_messages(response.text)
    events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    merged: dict[int, dict[str, Any]] = {}
    for event in map(orjson.loads, events[:-1]):
        for choice in event["choices"]:
            into = merged.setdefault(choice["index"], {"text": "", "logprobs": [], "finish_reason": None})
            delta = choice.get("delta") or {}
            into["text"] += choice.get("text") or delta.get("content") or delta.get("reasoning") or ""
            logprobs = choice.get("logprobs") or {}
            into["logprobs"] += logprobs.get("content") or logprobs.get("tokens") or []
            into["finish_reason"] = choice.get("finish_reason") or into["finish_reason"]
    return merged


def _visible_messages(text: str) -> dict[str, Any]:
    merged: dict[str, Any] = {"blocks": {}, "stop_reason": None, "usage": None}
    for event in text.split("\n\n"):
        if not event:
            continue
        data = orjson.loads(event.split("\ndata: ", 1)[1])
        delta = data.get("delta") or {}
        if data["type"] == "content_block_delta":
            block = merged["blocks"].setdefault(data["index"], "")
            merged["blocks"][data["index"]] = block + (delta.get("text") or delta.get("thinking") or "")
        elif data["type"] == "message_delta":
            merged["stop_reason"], merged["usage"] = delta["stop_reason"], data["usage"]
    assert data["type"] == "message_stop"
    return merged


def _visible_responses(text: str) -> dict[str, Any]:
    merged: dict[str, Any] = {"text": "", "status": None, "usage": None}
    for event in text.split("\n\n"):
        if not event:
            continue
        data = orjson.loads(event.split("\ndata: ", 1)[1])
        if data["type"].endswith(".delta"):
            merged["text"] += data["delta"]
        elif data["type"] == "response.completed":
            merged["status"], merged["usage"] = data["response"]["status"], data["response"]["usage"]
    assert data["type"] == "response.completed"
    return merged


def _render_ids(stack: RunningStack, path: str, body: dict[str, Any]) -> list[list[int]]:
    """The semantic prompt ids, as the render sidecar makes them."""
    url = stack.config.render_config.endpoint.url + path + "/render"
    rendered = httpx.post(url, json=body, timeout=30, trust_env=False).json()
    return [r["token_ids"] for r in (rendered if isinstance(rendered, list) else [rendered])]


@pytest.mark.parametrize("case", list(CASES))
def test_the_client_sees_what_a_plain_gateway_shows_and_engines_see_only_physical_ids(
    gw: Pair, stack: RunningStack, case: str
) -> None:
    path, body = CASES[case]
    plain = _visible(_post(gw.plain, path, body))
    assert _visible(_post(gw.obfuscated, path, body)) == plain

    semantic = _render_ids(stack, path, body)
    received = [r.json()["token_ids"] for r in gw.obfuscated.sims[0].generate_requests()]
    assert sorted(received) == sorted(gw.permutation.obfuscate(ids) for ids in semantic)
    assert all(r != ids for r, ids in zip(sorted(received), sorted(semantic), strict=True))

    gw.obfuscated.sims[0].obfuscation = None  # plain weights behind an obfuscating gateway: other text
    try:
        assert _visible(_post(gw.obfuscated, path, body)) != plain
    finally:
        gw.obfuscated.sims[0].obfuscation = gw.permutation


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_stop_token_an_answer_ended_on_is_named_by_its_semantic_id(gw: Pair, stream: bool) -> None:
    """`stop_reason` of an answer that ended on a stop token is an id: the engine's is physical."""
    stop = 500
    body = {**COMPLETION, "stop_token_ids": [stop], "stream": stream, "logprobs": None}
    reasons = []
    for gateway in (gw.plain, gw.obfuscated):
        sim = gateway.sims[0]
        sim.tokens, sim.finish_reason, sim.stop_reason = [300, 301, stop], "stop", stop
        try:
            answer = _post(gateway, "/v1/completions", body)
        finally:
            sim.finish_reason, sim.stop_reason = "length", None
        assert answer.status_code == 200, answer.text
        lines = [line for line in answer.text.splitlines() if line.startswith("data: {")]
        choices = (
            [c for line in lines for c in orjson.loads(line[6:])["choices"]] if stream else answer.json()["choices"]
        )
        reasons.append([(c["finish_reason"], c["stop_reason"]) for c in choices if c["finish_reason"]])
    assert reasons[0] == reasons[1] == [("stop", stop)]


def test_render_down_is_a_503_and_the_local_tokenizer_is_never_loaded(gw: Pair) -> None:
    gw.proxy.faults.append(RenderFault("render", "status", status=503))
    response = _post(gw.obfuscated, "/v1/chat/completions", CHAT)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "render_unavailable"
    state = gw.obfuscated.state()["tokenization"]
    assert state["local_tokenizer_loaded"] is False
    assert gw.obfuscated.sims[0].received == []


@pytest.mark.parametrize("path", ["/v1/embeddings"])
def test_text_apis_an_engine_would_tokenize_itself_are_501(gw: Pair, path: str) -> None:
    response = _post(gw.obfuscated, path, {"model": "tiny", "input": "hi"})
    assert response.status_code == 501, response.text
    assert response.json()["error"]["type"]
    assert gw.obfuscated.sims[0].received == []
    models = httpx.get(gw.obfuscated.base_url + "/v1/models", timeout=10, trust_env=False)
    assert models.status_code == 200


def test_the_secret_is_in_no_log_metric_error_or_config(gw: Pair) -> None:
    gw.proxy.faults.append(RenderFault("render", "status", status=503))
    seen = [_post(gw.obfuscated, "/v1/completions", COMPLETION).text]
    gw.proxy.faults.clear()
    seen.append(_post(gw.obfuscated, "/v1/completions", {**COMPLETION, "prompt": [10**9]}).text)
    admin = f"http://127.0.0.1:{gw.obfuscated.config.processor.admin_port}"
    seen += [httpx.get(admin + p, timeout=10, trust_env=False).text for p in ("/metrics", "/debug/state")]
    work = gw.obfuscated.gateway.work_dir
    seen += [p.read_text(errors="replace") for p in work.rglob("*") if p.is_file() and p.name != "secret"]
    seen.append(gw.obfuscated.config.to_yaml())
    assert len(seen) > 6
    for text in seen:
        assert SECRET not in text and SECRET.split()[-1] not in text


def test_an_id_outside_the_vocabulary_is_a_400(gw: Pair) -> None:
    response = _post(gw.obfuscated, "/v1/completions", {**COMPLETION, "prompt": [10**9]})
    assert response.status_code == 400, response.text
    assert gw.obfuscated.sims[0].received == []


def test_an_engine_without_token_only_generate_is_a_503_with_no_native_call(gw: Pair) -> None:
    """Last in the module: the engine loses its token-only route while the gateway runs."""
    sim = gw.obfuscated.sims[0]
    sim.fault = Fault("status", status=404)
    response = _post(gw.obfuscated, "/v1/completions", COMPLETION)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "token_only_required"
    assert [r.path for r in sim.received] == ["/inference/v1/generate"]
    # Its record is refreshed at once and holds it out: a stream is refused before any engine
    # call, where it would have gone native.
    deadline = time.monotonic() + 10
    while "obfuscation" not in str(gw.obfuscated.state()["capabilities"]["engines"][sim.address].get("held_out")):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    again = _post(gw.obfuscated, "/v1/chat/completions", {**CHAT, "stream": True})
    assert again.status_code == 503, again.text
    assert "token obfuscation forbids its native endpoint" in again.json()["error"]["message"]
    assert [r.path for r in sim.received] == ["/inference/v1/generate"]
