"""Capability negotiation through real Envoy, processor and render, over engine simulators
that announce what vLLM 0.32 announces: engines without scale-out served natively from their
first request, config mismatches adopted or held out, a different tokenizer held out, a
render endpoint whose canary differs not used, an engine that appears later joining,
`/ready` waiting for a record, and a dead engine leaving routing (and `/ready`) within a
second or two and coming back as fast."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI

from ext_proc.config import Endpoint
from ext_proc.fleet.capability_probe import CANARY_CHAT
from ext_proc.tools.local_stack import LocalStack
from tests.conftest import RunningStack, SimGateway, gateway_config, start_gateway, start_sim_gateway
from tests.engine_sim import EngineSim, SimServer

MESSAGES = [{"role": "user", "content": "What can you do?"}]
FAST_RETRY = {"retry_min_s": 0.2, "retry_max_s": 1.0}


def render_canary(stack: RunningStack) -> list[int]:
    """What the stack's real render sidecar renders the gateway's canary chat into."""
    url = stack.config.render_config.endpoint.url + "/v1/chat/completions/render"
    body = {"model": "tiny", "messages": CANARY_CHAT}
    ids: list[int] = httpx.post(url, json=body, timeout=10, trust_env=False).json()["token_ids"]
    return ids


@contextlib.contextmanager
def sims_gateway(stack: RunningStack, work: Path, sims: list[EngineSim], **sections: Any) -> Iterator[SimGateway]:
    """A gateway over these simulators, configured before the processor first probes them."""
    servers = [SimServer(sim).start() for sim in sims]
    try:
        config, gateway = start_gateway(stack, work, [Endpoint(port=s.port) for s in servers], **sections)
        try:
            yield SimGateway(config, gateway, sims)
        finally:
            gateway.stop()
    finally:
        for server in servers:
            server.close()


def client(gateway: SimGateway) -> OpenAI:
    return OpenAI(base_url=gateway.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


def engines(gateway: SimGateway) -> dict[str, dict[str, Any]]:
    records: dict[str, dict[str, Any]] = gateway.state()["capabilities"]["engines"]
    return records


def paths(sim: EngineSim) -> set[str]:
    return {r.path for r in sim.received}


def wait_for(check: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_an_engine_without_scale_out_is_served_natively_from_its_first_request(
    stack: RunningStack, tmp_path: Path
) -> None:
    plain, tokens = EngineSim(scale_out=False), EngineSim()
    with sims_gateway(stack, tmp_path, [tokens, plain], scheduler={"policy": "round_robin"}) as gateway:
        records = engines(gateway)
        assert records[plain.address]["token_only"] == "disabled" and records[plain.address]["path"] == "native"
        assert records[tokens.address]["token_only"] == "live" and records[tokens.address]["path"] == "token_only"
        api = client(gateway)
        # round robin alternates the engines: this order gives each both APIs, streaming and not
        for n, api_kind in enumerate(["chat", "completions", "completions", "chat"] * 2):
            if api_kind == "chat":
                chat = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, stream=n > 3)
                assert list(chat) if n > 3 else chat.choices[0].finish_reason  # type: ignore[arg-type,union-attr]
            else:
                text = api.completions.create(model="tiny", prompt="Hello", max_tokens=4, stream=n > 3)
                assert list(text) if n > 3 else text.choices[0].text  # type: ignore[arg-type,union-attr]
        # Messages are chat inside, which the plain engine gets; Responses go to its own route
        for n in range(4):
            messages = {"model": "tiny", "max_tokens": 4, "messages": MESSAGES, "stream": n > 1}
            answer = httpx.post(gateway.base_url + "/v1/messages", json=messages, timeout=30, trust_env=False)
            assert answer.status_code == 200 and (n > 1 or answer.json()["type"] == "message"), answer.text
            responses = {"model": "tiny", "max_output_tokens": 4, "input": "Hello", "stream": n > 1}
            answer = httpx.post(gateway.base_url + "/v1/responses", json=responses, timeout=30, trust_env=False)
            assert answer.status_code == 200 and (n > 1 or answer.json()["object"] == "response"), answer.text
            assert n < 2 or answer.text.rstrip().endswith("}") and "response.completed" in answer.text
        assert paths(plain) == {"/v1/chat/completions", "/v1/completions", "/v1/responses"}  # never a 403
        assert paths(tokens) == {"/inference/v1/generate"}
        state = gateway.assert_no_leaks()
        assert state["native_replays"] == 0
        assert {i["breaker"] for i in state["scheduler"]["instances"].values()} == {"closed"}

        # The engine restarts without scale-out: its first 403 is replayed natively (no client
        # sees it, no breaker counts it) and its record is refreshed at once.
        tokens.scale_out = False
        for _ in range(2):
            answer = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
            assert answer.choices[0].finish_reason
        wait_for(lambda: engines(gateway)[tokens.address].get("token_only") == "disabled")
        state = gateway.assert_no_leaks()
        assert state["native_replays"] == 1
        assert {i["breaker"] for i in state["scheduler"]["instances"].values()} == {"closed"}


def test_mismatches_are_adopted(stack: RunningStack, tmp_path: Path) -> None:
    """on_mismatch adopt: a smaller context gets only what fits; a pool whose engines all
    hash blocks of another size gets its index in theirs."""
    short, other = EngineSim(max_model_len=64, block_size=16), EngineSim(block_size=16)
    capabilities = {"on_mismatch": "adopt", **FAST_RETRY}
    with sims_gateway(stack, tmp_path, [short, other], capabilities=capabilities) as gateway:
        state = gateway.state()["capabilities"]
        assert state["block_sizes"] == {"union": 16}
        assert state["engines"][short.address]["adopted"] == {"max_model_len": 64, "block_size": 16}
        assert all(record["routes"] for record in state["engines"].values())
        api = client(gateway)
        for _ in range(4):  # prompt + 100 tokens do not fit in 64: only `other` takes them
            api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=100)
        assert not short.generate_requests() and len(other.generate_requests()) == 4
        gateway.assert_no_leaks()


def test_mismatches_and_another_tokenizer_are_held_out(stack: RunningStack, tmp_path: Path) -> None:
    canary = render_canary(stack)
    short, blocks = EngineSim(max_model_len=64, canary_ids=canary), EngineSim(block_size=16)
    stranger, good = EngineSim(canary_ids=[*canary[:-1], canary[-1] + 1]), EngineSim(canary_ids=canary)
    sims = [short, blocks, stranger, good]
    capabilities = {"on_mismatch": "hold_out", **FAST_RETRY}
    with sims_gateway(stack, tmp_path, sims, capabilities=capabilities, logging={"format": "json"}) as gateway:
        records = engines(gateway)
        assert records[short.address]["held_out"] == "differs from config: max_model_len 64 (config 2048)"
        assert records[blocks.address]["held_out"] == "differs from config: block_size 16 (config 128)"
        assert records[stranger.address]["held_out"] == "tokenizer mismatch: canary ids differ"
        assert records[stranger.address]["tokenizer"] == "mismatch"
        assert records[good.address]["routes"] and records[good.address]["tokenizer"] == "agrees"
        api = client(gateway)
        for _ in range(6):
            api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
        assert [len(sim.generate_requests()) for sim in sims] == [0, 0, 0, 6]
        log = gateway.gateway.processes["processor"].log_path.read_text()
        assert f"engine {stranger.address} held out: tokenizer mismatch" in log
        info = gateway.metrics()
        assert info[("tito_instance_routes", frozenset({("instance", good.address)}))] == 1
        assert info[("tito_instance_routes", frozenset({("instance", stranger.address)}))] == 0
        gateway.assert_no_leaks()


def test_a_render_endpoint_whose_canary_differs_is_not_used(stack: RunningStack, tmp_path: Path) -> None:
    """Both engines tokenize the canary alike, render otherwise: render is the odd one out,
    and requests are tokenized locally (served natively) until it agrees again."""
    other = [7, 8, 9]
    sims = [EngineSim(canary_ids=other), EngineSim(canary_ids=other)]
    with sims_gateway(stack, tmp_path, sims) as gateway:
        state = gateway.state()
        assert state["tokenization"]["render_held_out"] == "render_canary_mismatch"
        assert [r["used"] for r in state["capabilities"]["render"].values()] == [False]
        assert all(r["routes"] for r in state["capabilities"]["engines"].values())
        answer = client(gateway).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
        assert answer.choices[0].finish_reason  # the local tokenizer's ids, the native path
        assert {r.path for sim in sims for r in sim.received} == {"/v1/chat/completions"}
        assert gateway.state()["tokenization"]["fallbacks"] == {"render_canary_mismatch": 1}
        gateway.assert_no_leaks()


def test_an_engine_that_appears_later_joins_and_ready_waits_for_it(stack: RunningStack, tmp_path: Path) -> None:
    """No engine answers at start: `/ready` is 503 (Envoy sends nothing), through several of the
    probe's retries (at most 1 s apart here). The engine comes up 6 s later and joins without
    a restart."""
    sim = EngineSim()
    server = SimServer(sim).start()
    server.stop()  # its port is known, nothing listens on it yet
    sections = {"model": {**stack.config.model.model_dump(), "path": stack.model_path}, "capabilities": FAST_RETRY}
    config = gateway_config(
        tmp_path, stack.config.render_config.endpoint.port, [Endpoint(port=sim.port)], None, **sections
    )
    gateway = LocalStack(config, tmp_path)
    admin = f"http://127.0.0.1:{config.processor.admin_port}"
    try:
        gateway.start_gateway()
        wait_for(lambda: _get(admin + "/debug/state") is not None, 30)
        started = time.monotonic()
        while time.monotonic() - started < 6:
            ready = httpx.get(admin + "/ready", timeout=5, trust_env=False)
            assert ready.status_code == 503 and ready.json()["capabilities"] is False
            time.sleep(1)
        server.restart()
        wait_for(lambda: httpx.get(admin + "/ready", timeout=5, trust_env=False).status_code == 200, 10)
        api = OpenAI(base_url=f"http://127.0.0.1:{config.listener.port}/v1", api_key="unused", max_retries=0)
        wait_for(lambda: _serves(api), 15)  # Envoy's health check of the processor passes too
        assert sim.generate_requests()
    finally:
        gateway.stop()
        server.close()


def ready(gateway: SimGateway) -> httpx.Response:
    """The processor's `/ready` (its admin port)."""
    return httpx.get(f"http://127.0.0.1:{gateway.config.processor.admin_port}/ready", timeout=5, trust_env=False)


def chat(gateway: SimGateway) -> httpx.Response:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    return httpx.post(gateway.base_url + "/v1/chat/completions", json=body, timeout=10, trust_env=False)


def assert_refused_by_the_gateway(answer: httpx.Response, address: str) -> None:
    """The processor's own 503, in OpenAI's envelope, naming the engine and why it is out."""
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "no_healthy_instance"
    assert f"{address}: unreachable: " in error["message"], error


def test_a_dead_engine_takes_its_pool_out_of_ready_and_a_restarted_one_puts_it_back(
    stack: RunningStack, tmp_path: Path
) -> None:
    """Issue 41: the pool's only engine dies, no traffic. Its liveness check (every second)
    holds it out: `/ready` is 503 within 2 s and names the pool and why, the record keeps
    its facts, and a request gets the gateway's 503 at once. Restarted, it routes again
    within 2 s of its probe, which its first passing check brings on: by its backoff
    (retry_min_s 4 s, then 8 s) the next probe was more than 5 s away."""
    capabilities = {"retry_min_s": 4, "retry_max_s": 30}
    gateway, servers = start_sim_gateway(stack, tmp_path, 1, capabilities=capabilities)
    sim, server = gateway.sims[0], servers[0]
    try:
        assert chat(gateway).status_code == 200 and ready(gateway).status_code == 200
        gateway.reset()
        server.stop()
        stopped = time.monotonic()
        wait_for(lambda: ready(gateway).status_code == 503, 2)
        answer = ready(gateway).json()
        assert answer["capabilities"] is False
        reason = f"pool union: no engine routes ({sim.address} unreachable: "
        assert [r for r in answer["reasons"] if r.startswith(reason)], answer
        record = engines(gateway)[sim.address]
        assert not record["routes"] and record["held_out"].startswith("unreachable: ")
        assert (record["complete"], record["served_models"], record["token_only"]) == (True, ["tiny"], "live")
        assert gateway.metrics()[("tito_instance_routes", frozenset({("instance", sim.address)}))] == 0

        started = time.monotonic()
        assert_refused_by_the_gateway(chat(gateway), sim.address)
        assert time.monotonic() - started < 2 and not sim.generate_requests()

        # down past its first probe (4 s after the failed check), well before the next (8 s later)
        time.sleep(max(0.0, stopped + 6.5 - time.monotonic()))
        probes = len(sim.probes)
        server.restart()
        restarted = time.monotonic()
        wait_for(lambda: "/v1/models" in sim.probes[probes:], 1.5)  # its first passing check's probe
        probed = time.monotonic()
        wait_for(lambda: ready(gateway).status_code == 200, 2)
        assert time.monotonic() - probed < 2 and time.monotonic() - restarted < 3.5
        assert engines(gateway)[sim.address]["routes"]
        assert chat(gateway).status_code == 200
        log = gateway.gateway.processes["processor"].log_path.read_text()
        out = log.index(f"engine {sim.address} held out: unreachable: ")
        assert log.index(f"engine {sim.address} routes, token-only", out) > out
        gateway.assert_no_leaks()
    finally:
        gateway.gateway.stop()
        for server in servers:
            server.close()


def test_a_request_that_finds_its_engine_dead_takes_it_out_at_once(stack: RunningStack, tmp_path: Path) -> None:
    """Liveness checks a minute apart: the request that failed to connect brings its
    engine's check on, so the next request and `/ready` know at once."""
    capabilities = {"health_interval_s": 60, **FAST_RETRY}
    gateway, servers = start_sim_gateway(stack, tmp_path, 1, capabilities=capabilities)
    sim, server = gateway.sims[0], servers[0]
    try:
        assert chat(gateway).status_code == 200
        server.stop()
        first = chat(gateway)  # Envoy could not connect: its own 503, in OpenAI's envelope
        assert first.status_code == 503 and "error" in first.json()
        wait_for(lambda: ready(gateway).status_code == 503, 1)
        assert_refused_by_the_gateway(chat(gateway), sim.address)
        server.restart()  # probed again with the backoff (FAST_RETRY: within a second)
        wait_for(lambda: ready(gateway).status_code == 200, 3)
        assert chat(gateway).status_code == 200
    finally:
        gateway.gateway.stop()
        for server in servers:
            server.close()


def _get(url: str) -> Any:
    try:
        return httpx.get(url, timeout=2, trust_env=False).json()
    except httpx.HTTPError:
        return None


def _serves(api: OpenAI) -> bool:
    try:
        api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    except Exception:  # noqa: BLE001 - not yet
        return False
    return True
