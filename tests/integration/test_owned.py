"""Processor-owned streams through real Envoy, the real render sidecar and engine simulators:
multi-prompt fan-out/merge (streaming and not), relay of a single-prompt stream after an
engine failure, cancellation and backpressure. Every test proves that nothing was left
behind: no live exchange, no open engine stream, the ledger and load at zero."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import RunningStack, SimGateway, leak_checked, metric, running_sim_gateway
from tests.engine_sim import Fault

QUEUE_DEPTH = 4
BUDGET = 1100  # tokens: every test's requests fit, except the batch meant not to
BATCH = {"model": "tiny", "prompt": ["one", "two two", "three three three"], "max_tokens": 6, "n": 2, "seed": 7}


@pytest.fixture(scope="module")
def owned(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimGateway]:
    with running_sim_gateway(
        stack,
        tmp_path_factory.mktemp("owned"),
        3,
        processor={"owned_queue_depth": QUEUE_DEPTH},
        admission={"global_token_budget": BUDGET},
        scheduler={"policy": "round_robin", "breaker": {"failure_threshold": 1000}},
        reschedule={"enable": True, "first_token_timeout_s": 2.0, "inter_token_timeout_s": 1.0},
        logging={"format": "json"},
    ) as gateway:
        yield gateway


@pytest.fixture
def gw(owned: SimGateway) -> Iterator[SimGateway]:
    yield from leak_checked(owned)


def _events(body: bytes) -> list[Any]:
    """The SSE payloads, parsed ([DONE] as the string)."""
    payloads = [line[6:] for line in body.decode().split("\n\n") if line.startswith("data: ")]
    return [p if p == "[DONE]" else orjson.loads(p) for p in payloads]


def _texts(events: list[Any]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for event in events:
        if isinstance(event, dict):
            for choice in event.get("choices") or []:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return texts


def _generate_calls(gw: SimGateway) -> list[tuple[str, dict[str, Any]]]:
    return [(sim.address, r.json()) for sim in gw.sims for r in sim.generate_requests()]


def _wait_cut(gw: SimGateway, streams: int, within: float = 1.0) -> float:
    start = time.monotonic()
    while sum(s.streams_cut for s in gw.sims) < streams and time.monotonic() - start < 5:
        time.sleep(0.02)
    waited = time.monotonic() - start
    assert sum(s.streams_cut for s in gw.sims) == streams
    return waited


# -- fan-out / merge -------------------------------------------------------------------------


def test_a_streamed_batch_is_one_merged_stream_equal_to_the_whole_answer(gw: SimGateway) -> None:
    whole = httpx.post(gw.base_url + "/v1/completions", json=BATCH, timeout=30)
    assert whole.status_code == 200, whole.text
    answer = whole.json()
    assert [c["index"] for c in answer["choices"]] == list(range(6))
    calls = _generate_calls(gw)
    assert {body["request_id"] for _, body in calls} == {f"{answer['id']}-{i}" for i in range(3)}  # a leg per prompt
    gw.reset()
    body = {**BATCH, "stream": True, "stream_options": {"include_usage": True}}
    streamed = httpx.post(gw.base_url + "/v1/completions", json=body, timeout=30)
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    events = _events(streamed.content)
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    usage_chunks = [e for e in events[:-1] if e.get("usage")]
    assert len(usage_chunks) == 1 and usage_chunks[0] is events[-2]
    counts = {k: v for k, v in answer["usage"].items() if v is not None}  # a stream's usage omits nulls, as natively
    assert usage_chunks[0]["usage"] == counts
    assert usage_chunks[0]["usage"]["completion_tokens"] == 3 * 2 * 6
    assert _texts(events) == {c["index"]: c["text"] for c in answer["choices"]}
    assert len({len(text) for text in _texts(events).values()}) > 1  # prompts really differ


def test_one_prompt_failing_ends_the_stream_and_cuts_every_sibling(gw: SimGateway) -> None:
    fault = Fault("abort", after_tokens=5, times=1)  # whichever engine serves a prompt first
    for sim in gw.sims:
        sim.fault = fault
        sim.token_delay_s = 0.05
    body = {**BATCH, "n": 1, "max_tokens": 40, "stream": True}
    response = httpx.post(gw.base_url + "/v1/completions", json=body, timeout=30)
    events = _events(response.content)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert events[-2]["error"]["code"] == "engine_stream_failed"
    assert _wait_cut(gw, 3) < 1.0  # the aborted stream and both siblings, long before their 40 tokens


def test_a_batch_over_the_budget_is_a_429_and_takes_nothing(gw: SimGateway) -> None:
    body = {**BATCH, "max_tokens": 400, "n": 1}  # each prompt fits the budget alone, all three do not
    response = httpx.post(gw.base_url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 429, response.text
    assert response.json()["error"]["code"] == "token_budget_exceeded"
    assert not _generate_calls(gw)
    one = httpx.post(gw.base_url + "/v1/completions", json={**body, "prompt": "one"}, timeout=30)
    assert one.status_code == 200


def test_a_client_leaving_a_batch_closes_every_engine_stream(gw: SimGateway) -> None:
    for sim in gw.sims:
        sim.token_delay_s = 0.05
    body = {**BATCH, "n": 1, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", gw.base_url + "/v1/completions", json=body, timeout=30) as response:
        for _ in response.iter_raw():
            break
    assert _wait_cut(gw, 3) < 1.0
    assert not gw.state()["exchanges"]


def test_a_slow_reader_holds_the_engines_back_and_loses_nothing(gw: SimGateway) -> None:
    ids = list(range(100, 1100))
    for sim in gw.sims:
        sim.tokens = ids
    body = {"model": "tiny", "prompt": "slow", "max_tokens": 1000, "stream": True, "return_token_ids": True}
    with httpx.stream("POST", gw.base_url + "/v1/completions", json=body, timeout=60) as response:
        chunks = response.iter_raw(64)
        received = [next(chunks)]
        for _ in range(3):  # a reader at 1 chunk/s, against an engine at full speed
            time.sleep(1)
            received.append(next(chunks))
        received += list(chunks)
    assert 0 < gw.state()["owned_queue_depth_max"] <= QUEUE_DEPTH
    events = _events(b"".join(received))
    assert events[-1] == "[DONE]"
    assert [i for e in events[:-1] for c in e["choices"] for i in c["token_ids"] or []] == ids


# -- relay -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["abort", "inband_error", "stall"])
def test_relay_continues_on_another_engine_from_the_committed_ids(gw: SimGateway, kind: str) -> None:
    fault = Fault(kind, after_tokens=7, times=1)  # the first engine stream, wherever it goes
    for sim in gw.sims:
        sim.fault = fault
    body = {"model": "tiny", "prompt": "relay me", "max_tokens": 20, "stream": True, "return_token_ids": True}
    relays = metric(gw.metrics(), "tito_relays_total")
    response = httpx.post(gw.base_url + "/v1/completions", json=body, timeout=30)
    events = _events(response.content)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert not any("error" in e for e in events[:-1])
    calls = _generate_calls(gw)
    assert len(calls) == 2
    (first_host, first), (second_host, second) = sorted(calls, key=lambda call: len(call[1]["token_ids"]))
    assert first_host != second_host
    # The relay is one stage line (which engine failed, where it went on, after how many ids)
    # between the two generate legs, and one more on the counter.
    stages = gw.stages(response.headers["x-request-id"], until="relay")
    assert [(s["stage"], s.get("failed"), s.get("to"), s.get("committed_tokens")) for s in stages] == [
        ("generate", None, None, None),
        ("relay", first_host, second_host, 7),
        ("generate", None, None, None),
    ]
    assert metric(gw.metrics(), "tito_relays_total") == relays + 1
    prompt, committed = second["token_ids"][: len(first["token_ids"])], second["token_ids"][len(first["token_ids"]) :]
    assert prompt == first["token_ids"] and committed == gw.sims[0].script(first["token_ids"], 20)[:7]
    assert second["sampling_params"]["max_tokens"] == 20 - 7
    # every id exactly once, in order: the first engine's 7, then the second engine's 13
    streamed = [i for e in events[:-1] for c in e["choices"] for i in c["token_ids"] or []]
    assert streamed == committed + gw.sims[0].script(second["token_ids"], 13)
    # and the text is what one engine emitting those 20 ids gives
    for sim in gw.sims:
        sim.tokens = streamed
    whole = httpx.post(gw.base_url + "/v1/completions", json={**body, "stream": False}, timeout=30).json()
    assert _texts(events) == {0: whole["choices"][0]["text"]}


def test_relay_is_refused_for_n_above_one_once_output_exists(gw: SimGateway) -> None:
    fault = Fault("abort", after_tokens=3, times=1)
    for sim in gw.sims:
        sim.fault = fault
    body = {"model": "tiny", "prompt": "two choices", "max_tokens": 10, "n": 2, "stream": True}
    events = _events(httpx.post(gw.base_url + "/v1/completions", json=body, timeout=30).content)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_stream_failed"
    assert len(_generate_calls(gw)) == 1


def test_a_client_leaving_a_relayed_stream_closes_its_engine_stream(gw: SimGateway) -> None:
    for sim in gw.sims:
        sim.token_delay_s = 0.05
    body = {"model": "tiny", "prompt": "leave", "max_tokens": 200, "stream": True}
    with httpx.stream("POST", gw.base_url + "/v1/completions", json=body, timeout=30) as response:
        for _ in response.iter_raw():
            break
    assert _wait_cut(gw, 1) < 1.0


# -- beam search -----------------------------------------------------------------------------

BEAM = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 3,
    "n": 2,
    "use_beam_search": True,
    "seed": 3,  # (native's engine steps carry none of these)
    "stop": ["never"],
}


def test_beam_search_is_one_token_steps_per_beam_on_the_chosen_engine(gw: SimGateway) -> None:
    response = httpx.post(gw.base_url + "/v1/chat/completions", json=BEAM, timeout=30)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert answer["usage"]["completion_tokens"] == 6  # two beams of 3: the simulator's ids are never EOS
    calls = _generate_calls(gw)
    assert len({host for host, _ in calls}) == 1  # the placed instance holds every beam's prefix
    lengths = sorted(len(call["token_ids"]) for _, call in calls)
    prompt = lengths[0]
    assert lengths == [prompt, prompt + 1, prompt + 1, prompt + 2, prompt + 2]  # the prompt, then 2 beams
    for _, call in calls:  # 2 × n candidates; the request's temperature, nothing else of it
        assert call["sampling_params"] == {"max_tokens": 1, "temperature": 1.0, "logprobs": 4, "detokenize": False}
        assert call["stream"] is False


def test_a_failed_beam_step_is_the_clients_error_and_gives_its_lease_back(gw: SimGateway) -> None:
    for sim in gw.sims:
        sim.fault = Fault("status", status=500)
    response = httpx.post(gw.base_url + "/v1/chat/completions", json=BEAM, timeout=30)
    assert response.status_code == 500, response.text
    assert response.json()["error"]["message"] == "simulated engine failure 500"


def test_a_client_leaving_a_beam_search_stops_its_steps(gw: SimGateway) -> None:
    for sim in gw.sims:
        sim.ttft_s = 0.2
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw.base_url + "/v1/chat/completions", json={**BEAM, "max_tokens": 40}, timeout=0.5)
    time.sleep(0.5)
    steps = len(_generate_calls(gw))
    time.sleep(1.0)
    assert len(_generate_calls(gw)) == steps <= 5  # 40 steps of 2 beams would be 79
    assert not gw.state()["exchanges"]


# -- engine-side coalescing ------------------------------------------------------------------


@pytest.fixture(scope="module")
def coalesced(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimGateway]:
    """Engines asked for 4 tokens per event (`derender.stream_interval`), placed by the default
    policy (prefix affinity), whose breaker never opens here."""
    with running_sim_gateway(
        stack,
        tmp_path_factory.mktemp("coalesced"),
        2,
        derender={"stream_interval": 4},
        scheduler={"breaker": {"failure_threshold": 1000}},
        reschedule={"enable": True, "first_token_timeout_s": 2.0, "inter_token_timeout_s": 1.0},
        logging={"format": "json"},
    ) as gateway:
        gateway.restore()
        yield gateway
        gateway.assert_no_leaks()


def test_relay_and_fan_out_at_four_tokens_per_engine_event(coalesced: SimGateway) -> None:
    """The engine's third event never comes (its first carries one token, its second four):
    the relay goes on from the 5 committed ids, asking the next engine for 4 per event too,
    and a batch merges as it does one token at a time. The relay's prompt starts with the
    first engine's, so prefix affinity alone would send it back there: it must not."""
    fault = Fault("abort", after_tokens=2, times=1)  # counted in engine events
    for sim in coalesced.sims:
        sim.fault = fault
    prompt = "relay me " * 64  # two 128-token blocks of prefix for the affinity to match
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 20, "stream": True, "return_token_ids": True}
    events = _events(httpx.post(coalesced.base_url + "/v1/completions", json=body, timeout=30).content)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    calls = sorted(_generate_calls(coalesced), key=lambda call: len(call[1]["token_ids"]))
    assert [call["sampling_params"]["stream_interval"] for _, call in calls] == [4, 4]
    (first_host, first), (second_host, second) = calls
    assert first_host != second_host
    committed = second["token_ids"][len(first["token_ids"]) :]
    assert committed == coalesced.sims[0].script(first["token_ids"], 20)[:5]
    assert second["sampling_params"]["max_tokens"] == 15
    streamed = [i for e in events[:-1] for c in e["choices"] for i in c["token_ids"] or []]
    assert streamed == committed + coalesced.sims[0].script(second["token_ids"], 15)

    for sim in coalesced.sims:
        sim.fault = None
    batch = {**BATCH, "stream": True, "stream_options": {"include_usage": True}}
    streamed_batch = _events(httpx.post(coalesced.base_url + "/v1/completions", json=batch, timeout=30).content)
    whole = httpx.post(coalesced.base_url + "/v1/completions", json=BATCH, timeout=30).json()
    assert _texts(streamed_batch) == {c["index"]: c["text"] for c in whole["choices"]}
    usage = streamed_batch[-2]["usage"]
    assert usage == {key: whole["usage"][key] for key in usage} and usage["completion_tokens"] == 36
