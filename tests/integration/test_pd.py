"""Prefill/decode through real Envoy and the real render sidecar, over engine simulators
(2 prefill, 2 decode, 1 union): Handoff legs as the engines see them, PD-hybrid fallback,
prefill retries counted on breakers, and nothing left behind."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import RunningStack, SimGateway, metric, start_gateway
from tests.engine_sim import EngineSim, Fault, SimServer

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello 世界"}], "max_tokens": 5}


class PdBench:
    def __init__(self, gateway: SimGateway, servers: dict[str, list[SimServer]]) -> None:
        self.gateway, self.servers = gateway, servers

    def sims(self, role: str) -> list[EngineSim]:
        return [s.sim for s in self.servers[role]]

    def generate_calls(self, role: str) -> list[dict[str, Any]]:
        return [r.json() for sim in self.sims(role) for r in sim.generate_requests()]

    def forget(self) -> None:
        """What the engines received forgotten (the next request of a test that sends several)."""
        for group in self.servers.values():
            for server in group:
                server.sim.received.clear()
                server.sim.trigger_callbacks.clear()

    def calm(self) -> None:
        """Forgotten, and the engines' pace back to the default: the next test of a shared gateway."""
        self.forget()
        for group in self.servers.values():
            for server in group:
                server.sim.ttft_s = server.sim.token_delay_s = 0.0
                server.sim.streams_cut = 0

    def calls(self, role: str) -> list[tuple[str, dict[str, Any]]]:
        """(engine, generate body) of every generate the role's engines received."""
        return [(sim.address, r.json()) for sim in self.sims(role) for r in sim.generate_requests()]


@contextlib.contextmanager
def _pd_gateway(
    stack: RunningStack, work: Path, decode_capabilities: list[str], union: int = 1, **sections: Any
) -> Iterator[PdBench]:
    """A gateway of its own per test that scripts a fault (breaker state never carries over).
    A start costs 6-15 s (the processor imports vLLM), so the tests that script none share one
    per kind (`calm`)."""
    servers = {
        role: [SimServer(EngineSim()).start() for _ in range(n)]
        for role, n in (("prefill", 2), ("decode", 2), ("union", union))
        if n
    }
    pools = [
        {
            "name": role,
            "role": role,
            "instances": [
                {"port": s.sim.port, "capabilities": decode_capabilities if role == "decode" else []} for s in group
            ],
        }
        for role, group in servers.items()
    ]
    breaker = {"failure_threshold": 1, "base_cooldown_s": 60.0, "max_cooldown_s": 60.0}
    config, gateway = start_gateway(
        stack, work, [], pools=pools, scheduler={"policy": "round_robin", "breaker": breaker}, **sections
    )
    bench = PdBench(SimGateway(config, gateway, []), servers)
    try:
        yield bench
        bench.gateway.assert_no_leaks()
        assert bench.gateway.state()["trigger_waiting"] == 0
    finally:
        gateway.stop()
        for group in servers.values():
            for server in group:
                server.stop()


@pytest.fixture
def bench(stack: RunningStack, tmp_path: Path) -> Iterator[PdBench]:
    with _pd_gateway(stack, tmp_path, []) as pd:  # decode instances default to Handoff
        yield pd


# Shared by the tests that script no fault, one gateway per kind for the module: (decode
# capabilities, union instances).
_KINDS = {"handoff": ([], 1), "trigger": (["concurrent_engine_sync"], 1), "no_union": ([], 0)}


@pytest.fixture(scope="module")
def _shared(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, PdBench]]:
    with contextlib.ExitStack() as gateways:
        yield {
            kind: gateways.enter_context(_pd_gateway(stack, tmp_path_factory.mktemp(kind), caps, union=union))
            for kind, (caps, union) in _KINDS.items()
        }


def _calm(shared: PdBench) -> Iterator[PdBench]:
    """A shared gateway as a fresh one would be, left with nothing held."""
    shared.calm()
    yield shared
    shared.gateway.assert_no_leaks()


@pytest.fixture
def handoff(_shared: dict[str, PdBench]) -> Iterator[PdBench]:
    yield from _calm(_shared["handoff"])


@pytest.fixture
def trigger(_shared: dict[str, PdBench]) -> Iterator[PdBench]:
    yield from _calm(_shared["trigger"])


@pytest.fixture
def batches(_shared: dict[str, PdBench]) -> Iterator[PdBench]:
    yield from _calm(_shared["no_union"])


def test_handoff_is_one_prefill_then_one_decode_with_its_params(handoff: PdBench) -> None:
    for stream in (False, True):  # (one gateway: a start costs seconds)
        handoff.forget()
        _handoff(handoff, stream)


def _handoff(bench: PdBench, stream: bool) -> None:
    response = httpx.post(bench.gateway.base_url + "/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=30)
    assert response.status_code == 200
    if stream:
        assert response.text.endswith("data: [DONE]\n\n") and '"chat.completion.chunk"' in response.text
    else:
        assert response.json()["object"] == "chat.completion" and response.json()["usage"]["completion_tokens"] == 5
    [prefill] = bench.generate_calls("prefill")
    [decode] = bench.generate_calls("decode")
    assert bench.generate_calls("union") == []
    assert prefill["stream"] is False and prefill["sampling_params"]["max_tokens"] == 1
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert decode["token_ids"] == prefill["token_ids"]
    assert decode["kv_transfer_params"]["do_remote_prefill"] is True
    assert decode["kv_transfer_params"]["remote_request_id"] == "generate-tokens-" + prefill["request_id"]
    assert decode["sampling_params"]["extra_args"] == {"kv_transfer_params": decode["kv_transfer_params"]}
    assert decode["stream"] is stream and decode["sampling_params"]["max_tokens"] == 5


def test_a_failing_prefill_is_retried_on_the_other_and_counted(bench: PdBench) -> None:
    broken, healthy = bench.sims("prefill")
    broken.fault = Fault("status", status=500)
    healthy.fault = None
    for _ in range(2):  # round robin: one of the two requests picks the broken one first
        response = httpx.post(bench.gateway.base_url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert response.status_code == 200
    state = bench.gateway.state()["scheduler"]["instances"]
    assert state[broken.address]["breaker"] == "open"
    assert len(broken.generate_requests()) == 1
    decodes = bench.generate_calls("decode")
    assert len(decodes) == 2  # no decode call for the failed attempt
    assert {d["kv_transfer_params"]["remote_engine_id"] for d in decodes} == {f"sim-{healthy.port}"}


def test_every_prefill_down_is_served_by_the_union_pool(bench: PdBench) -> None:
    for sim in bench.sims("prefill"):
        sim.fault = Fault("status", status=503)
    response = httpx.post(bench.gateway.base_url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert response.status_code == 200 and response.json()["object"] == "chat.completion"
    assert bench.generate_calls("decode") == []
    [union] = bench.generate_calls("union")
    assert "kv_transfer_params" not in union
    # with every prefill breaker open, the next request is planned straight onto union
    again = httpx.post(bench.gateway.base_url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert again.status_code == 200 and len(bench.generate_calls("union")) == 2
    assert len(bench.generate_calls("prefill")) == 2


def test_nothing_healthy_is_a_503(bench: PdBench) -> None:
    sims = [*bench.sims("prefill"), *bench.sims("union")]
    for sim in sims:
        sim.fault = Fault("status", status=503)
    response = httpx.post(bench.gateway.base_url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert response.status_code == 503
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert bench.generate_calls("decode") == []


def test_a_client_leaving_during_decode_leaves_nothing(handoff: PdBench) -> None:
    for sim in handoff.sims("decode"):
        sim.token_delay_s = 0.05
    with httpx.stream(
        "POST",
        handoff.gateway.base_url + "/v1/chat/completions",
        json={**CHAT, "max_tokens": 200, "stream": True},
        timeout=30,
    ) as response:
        for _ in response.iter_raw():
            break  # one chunk, then the client is gone
    deadline = time.monotonic() + 5
    while sum(s.streams_cut for s in handoff.sims("decode")) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sum(s.streams_cut for s in handoff.sims("decode")) == 1


def test_trigger_sends_decode_first_and_prefill_when_its_engine_calls_back(trigger: PdBench) -> None:
    for stream in (False, True):
        trigger.forget()
        _trigger(trigger, stream)


def _trigger(trigger: PdBench, stream: bool) -> None:
    response = httpx.post(
        trigger.gateway.base_url + "/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=30
    )
    assert response.status_code == 200
    [decode] = trigger.generate_calls("decode")
    [prefill] = trigger.generate_calls("prefill")
    metaserver = decode["kv_transfer_params"]["metaserver"]
    assert metaserver == f"http://127.0.0.1:{trigger.gateway.config.processor.admin_port}/v1/metaserver?attempt=0"
    assert decode["kv_transfer_params"]["do_remote_prefill"] is True and decode["stream"] is stream
    assert [s for sim in trigger.sims("decode") for s in sim.trigger_callbacks] == [200]
    # the callback's params, with the forced fields and without the metaserver
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert prefill["kv_transfer_params"]["do_remote_prefill"] is False
    assert "metaserver" not in prefill["kv_transfer_params"] and prefill["kv_transfer_params"]["remote_engine_id"]
    assert prefill["sampling_params"]["max_tokens"] == 1 and prefill["sampling_params"]["min_tokens"] == 1
    assert prefill["token_ids"] == decode["token_ids"] and trigger.generate_calls("union") == []


def test_the_metaserver_refuses_unknown_requests_and_stale_attempts(trigger: PdBench) -> None:
    for sim in trigger.sims("decode"):
        sim.ttft_s = 1.0  # the request stays in flight after its callback
    metaserver = f"http://127.0.0.1:{trigger.gateway.config.processor.admin_port}/v1/metaserver"
    done: list[int] = []
    thread = threading.Thread(
        target=lambda: done.append(
            httpx.post(trigger.gateway.base_url + "/v1/chat/completions", json=CHAT, timeout=30).status_code
        )
    )
    thread.start()
    deadline = time.monotonic() + 10
    while not any(s.generate_requests() for s in trigger.sims("decode")) and time.monotonic() < deadline:
        time.sleep(0.02)
    [received] = [r for s in trigger.sims("decode") for r in s.generate_requests()]
    known = {"request_id": "generate-tokens-" + received.headers["x-request-id"], "kv_transfer_params": {}}
    assert httpx.post(metaserver + "?attempt=7", json=known, timeout=10).status_code == 409
    unknown = {"request_id": "generate-tokens-chatcmpl-nobody", "kv_transfer_params": {}}
    assert httpx.post(metaserver + "?attempt=0", json=unknown, timeout=10).status_code == 404
    thread.join()
    assert done == [200]
    assert httpx.post(metaserver + "?attempt=0", json=known, timeout=10).status_code == 404  # finished: forgotten


# -- processor-owned streams under Handoff: batches and relay ------------------------------------

BATCH = {"model": "tiny", "prompt": ["one", "two two", "three three three"], "max_tokens": 5, "seed": 3}
RELAY = {"enable": True, "first_token_timeout_s": 2.0, "inter_token_timeout_s": 1.0}


@pytest.fixture
def no_union(stack: RunningStack, tmp_path: Path) -> Iterator[PdBench]:
    with _pd_gateway(stack, tmp_path, [], union=0) as pd:
        yield pd


@pytest.fixture
def relaying(stack: RunningStack, tmp_path: Path) -> Iterator[PdBench]:
    with _pd_gateway(stack, tmp_path, [], reschedule=RELAY, logging={"format": "json"}) as pd:
        yield pd


def _payloads(body: str) -> list[Any]:
    return [line[6:] if line == "data: [DONE]" else orjson.loads(line[6:]) for line in body.split("\n\n") if line]


def _pairs(bench: PdBench) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Each decode leg with the prefill leg whose KV it loads (by its params), by prompt."""
    prefills = {"generate-tokens-" + p["request_id"]: p for p in bench.generate_calls("prefill")}
    pairs = {}
    for decode in bench.generate_calls("decode"):
        prefill = prefills[decode["kv_transfer_params"]["remote_request_id"]]
        assert decode["token_ids"] == prefill["token_ids"]
        assert prefill["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
        pairs[str(decode["token_ids"])] = (prefill, decode)
    return pairs


def test_a_batch_is_one_handoff_per_prompt_merged_as_one_answer(batches: PdBench) -> None:
    for stream in (False, True):
        batches.forget()
        _batch_handoff(batches, stream)


def _batch_handoff(no_union: PdBench, stream: bool) -> None:
    body = {**BATCH, "stream": stream, "stream_options": {"include_usage": True}} if stream else BATCH
    response = httpx.post(no_union.gateway.base_url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200
    pairs = _pairs(no_union)
    assert len(pairs) == 3 and len(no_union.generate_calls("prefill")) == 3
    assert {d["stream"] for _, d in pairs.values()} == {stream}
    if stream:
        events = _payloads(response.text)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        assert {c["index"] for e in events[:-1] for c in e["choices"]} == {0, 1, 2}
        assert events[-2]["usage"]["completion_tokens"] == 15
    else:
        answer = response.json()
        assert [c["index"] for c in answer["choices"]] == [0, 1, 2] and answer["usage"]["completion_tokens"] == 15


def test_a_batch_prompt_whose_prefill_fails_is_retried_on_another(no_union: PdBench) -> None:
    broken, _ = no_union.sims("prefill")
    broken.fault = Fault("status", status=500, times=1)
    response = httpx.post(no_union.gateway.base_url + "/v1/completions", json=BATCH, timeout=30)
    assert response.status_code == 200 and len(response.json()["choices"]) == 3
    assert len(no_union.generate_calls("prefill")) == 4 and len(_pairs(no_union)) == 3
    # counted on its breaker (which its other prompts' successes may close again at once)
    samples = no_union.gateway.metrics()
    assert metric(samples, "tito_breaker_transitions_total", instance=broken.address, state="open") == 1


def test_a_batch_with_every_prefill_down_is_served_by_union_per_prompt(bench: PdBench) -> None:
    for sim in bench.sims("prefill"):
        sim.fault = Fault("status", status=503)
    response = httpx.post(bench.gateway.base_url + "/v1/completions", json={**BATCH, "stream": True}, timeout=30)
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    assert bench.generate_calls("decode") == [] and len(bench.generate_calls("union")) == 3


def test_without_prefill_or_pair_the_error_says_so(no_union: PdBench) -> None:
    for sim in no_union.sims("prefill"):
        sim.fault = Fault("status", status=503)
    response = httpx.post(no_union.gateway.base_url + "/v1/completions", json=BATCH, timeout=30)
    assert response.status_code == 503
    assert response.json()["error"]["message"] == "no prefill instance could prefill the request"
    tried = len(no_union.generate_calls("prefill"))
    # both prefill breakers are open now, and no decode instance may serve alone: the prefill
    # pool is tried still (panic routing), and the answer says why it failed
    again = httpx.post(no_union.gateway.base_url + "/v1/completions", json={**BATCH, "prompt": "one"}, timeout=30)
    assert again.status_code == 503
    assert again.json()["error"]["message"] == "no prefill instance could prefill the request"
    assert len(no_union.generate_calls("prefill")) > tried and no_union.generate_calls("decode") == []


def test_a_client_leaving_a_batch_during_its_prefill_legs_cancels_them(batches: PdBench) -> None:
    for sim in batches.sims("prefill"):
        sim.ttft_s = 2.0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(batches.gateway.base_url + "/v1/completions", json={**BATCH, "stream": True}, timeout=0.5)
    batches.gateway.assert_no_leaks(timeout=5)  # every prefill and decode lease back, nothing open
    assert batches.generate_calls("decode") == []


def test_a_client_leaving_a_batch_mid_stream_cuts_every_decode_stream(batches: PdBench) -> None:
    for sim in batches.sims("decode"):
        sim.token_delay_s = 0.05
    body = {**BATCH, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", batches.gateway.base_url + "/v1/completions", json=body, timeout=30) as response:
        for _ in response.iter_raw():
            break
    deadline = time.monotonic() + 5
    while sum(s.streams_cut for s in batches.sims("decode")) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sum(s.streams_cut for s in batches.sims("decode")) == 3


@pytest.mark.parametrize("kind", ["abort", "inband_error", "stall"])
def test_relay_under_handoff_prefills_the_replay_prompt_again(relaying: PdBench, kind: str) -> None:
    fault = Fault(kind, after_tokens=4, times=1)
    for sim in relaying.sims("decode"):
        sim.fault = fault  # the first decode stream, wherever it goes
    body = {"model": "tiny", "prompt": "relay me", "max_tokens": 12, "stream": True, "return_token_ids": True}
    response = httpx.post(relaying.gateway.base_url + "/v1/completions", json=body, timeout=30)
    events = _payloads(response.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1 and not any("error" in e for e in events[:-1])
    decodes = sorted(relaying.calls("decode"), key=lambda call: len(call[1]["token_ids"]))
    (first_host, first), (second_host, second) = decodes
    assert first_host != second_host
    committed = relaying.sims("decode")[0].script(first["token_ids"], 12)[:4]
    assert second["token_ids"] == first["token_ids"] + committed and second["sampling_params"]["max_tokens"] == 8
    # a new prefill leg of the replay prompt came first, and the new decode leg loads its KV
    prefills = {"generate-tokens-" + p["request_id"]: p for p in relaying.generate_calls("prefill")}
    assert len(prefills) == 2
    assert prefills[second["kv_transfer_params"]["remote_request_id"]]["token_ids"] == second["token_ids"]
    streamed = [i for e in events[:-1] for c in e["choices"] for i in c["token_ids"] or []]
    assert streamed == committed + relaying.sims("decode")[0].script(second["token_ids"], 8)
    assert relaying.generate_calls("union") == []


def test_a_trigger_batch_goes_the_native_path(stack: RunningStack, tmp_path: Path) -> None:
    with _pd_gateway(stack, tmp_path, ["concurrent_engine_sync"], union=0) as trigger:
        for stream in (False, True):
            trigger.forget()
            response = httpx.post(
                trigger.gateway.base_url + "/v1/completions", json={**BATCH, "stream": stream}, timeout=30
            )
            assert response.status_code == 200
            native = [r for sim in trigger.sims("decode") for r in sim.received if r.path == "/v1/completions"]
            assert len(native) == 1 and native[0].json()["prompt"] == BATCH["prompt"]
            assert trigger.generate_calls("prefill") == trigger.generate_calls("decode") == []


@pytest.fixture
def trigger_relaying(stack: RunningStack, tmp_path: Path) -> Iterator[PdBench]:
    with _pd_gateway(stack, tmp_path, ["concurrent_engine_sync"], reschedule=RELAY) as pd:
        yield pd


def test_relay_under_trigger_sends_decode_first_again_with_a_new_attempt(trigger_relaying: PdBench) -> None:
    fault = Fault("abort", after_tokens=4, times=1)
    for sim in trigger_relaying.sims("decode"):
        sim.fault = fault
    body = {"model": "tiny", "prompt": "relay me", "max_tokens": 12, "stream": True, "return_token_ids": True}
    response = httpx.post(trigger_relaying.gateway.base_url + "/v1/completions", json=body, timeout=30)
    events = _payloads(response.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1 and not any("error" in e for e in events[:-1])
    (first_host, first), (second_host, second) = sorted(
        trigger_relaying.calls("decode"), key=lambda call: len(call[1]["token_ids"])
    )
    assert first_host != second_host
    assert [first["kv_transfer_params"]["metaserver"][-9:], second["kv_transfer_params"]["metaserver"][-9:]] == [
        "attempt=0",
        "attempt=1",
    ]
    committed = trigger_relaying.sims("decode")[0].script(first["token_ids"], 12)[:4]
    assert second["token_ids"] == first["token_ids"] + committed
    prefills = trigger_relaying.generate_calls("prefill")  # one per decode leg, on its engine's callback
    assert sorted(len(p["token_ids"]) for p in prefills) == [len(first["token_ids"]), len(second["token_ids"])]
    assert [s for sim in trigger_relaying.sims("decode") for s in sim.trigger_callbacks] == [200, 200]
    streamed = [i for e in events[:-1] for c in e["choices"] for i in c["token_ids"] or []]
    assert streamed == committed + trigger_relaying.sims("decode")[0].script(second["token_ids"], 8)
