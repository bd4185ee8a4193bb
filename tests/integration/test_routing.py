"""Real Envoy + processor + real render sidecar over engine simulators: what the engine
receives, who chose it, and how failures reach the client."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import orjson
import pytest
from openai import OpenAI

from tests.conftest import RunningStack, SimGateway, start_sim_gateway
from tests.engine_sim import EngineSim

MESSAGES = [{"role": "user", "content": "Route me 你好 😀"}]


def _client(base_url: str) -> OpenAI:
    return OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _render_ids(stack: RunningStack, body: dict[str, object]) -> list[int]:
    url = stack.config.render_config.endpoint.url + "/v1/chat/completions/render"
    ids: list[int] = httpx.post(url, json=body, timeout=10, trust_env=False).json()["token_ids"]
    return ids


def test_engine_gets_token_only_generate_routed_by_processor_metadata(
    sim_gateway: SimGateway, stack: RunningStack
) -> None:
    sim_gateway.reset()
    client = _client(sim_gateway.base_url)
    spoofed = {"x-gateway-destination-endpoint": sim_gateway.sims[1].address}
    response_ids = []
    for i in range(12):
        if i % 2:
            chunks = list(
                client.chat.completions.create(
                    model="tiny", messages=MESSAGES, max_tokens=3, stream=True, extra_headers=spoofed
                )
            )
            response_ids.append(chunks[0].id)
        else:
            response_ids.append(
                client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, extra_headers=spoofed).id
            )

    received = [(n, r) for n, sim in enumerate(sim_gateway.sims) for r in sim.received]
    assert len(received) == 12
    expected_ids = _render_ids(stack, {"model": "tiny", "messages": MESSAGES})
    for _, record in received:
        assert record.path == "/inference/v1/generate"
        body = record.json()
        assert body["token_ids"] == expected_ids  # render's ids, not text
        assert "messages" not in body and "prompt" not in body
        assert body["sampling_params"]["max_tokens"] == 3
        assert "x-gateway-destination-endpoint" not in record.headers

    landed = {record.headers["x-request-id"]: n for n, record in received}
    assert all(rid.startswith("chatcmpl-") for rid in response_ids)
    order = [landed[rid] for rid in response_ids]  # the response id is the engine's request id
    # The processor's round robin alternates; the spoofed header would send all to sim 1,
    # Envoy's own (random) fallback would not alternate 12 times in a row.
    assert order in ([0, 1] * 6, [1, 0] * 6), order


def test_streaming_derender_matches_the_tokens_the_engine_sent(sim_gateway: SimGateway, stack: RunningStack) -> None:
    from transformers import AutoTokenizer

    sim_gateway.reset()
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": 40,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", sim_gateway.base_url + "/v1/chat/completions", json=body, timeout=30, trust_env=False
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw())
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and raw.count(b"data: [DONE]") == 1
    chunks = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    # The sidecar runs the qwen3 parser: without </think> all of it is reasoning.
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    text = "".join((d.get("reasoning") or "") + (d.get("content") or "") for d in deltas)
    usage = chunks[-1]["usage"]
    tokens = EngineSim.script(_render_ids(stack, body), 40)
    tokenizer = AutoTokenizer.from_pretrained(stack.model_path)
    assert text == tokenizer.decode(tokens, skip_special_tokens=True)
    assert usage["completion_tokens"] == 40
    assert usage["prompt_tokens"] == len(_render_ids(stack, body))
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}


def test_models_are_the_engines_lists_and_a_batch_is_a_leg_per_prompt(sim_gateway: SimGateway) -> None:
    sim_gateway.reset()
    models = httpx.get(sim_gateway.base_url + "/v1/models", timeout=10, trust_env=False)
    assert models.status_code == 200 and models.json()["data"] == [  # as the engines list it (their records)
        {"id": "tiny", "object": "model", "owned_by": "sim", "root": "/sim/tiny", "parent": None, "max_model_len": 2048}
    ]
    body = {"model": "tiny", "prompt": ["one", "two"], "max_tokens": 2}
    completion = httpx.post(sim_gateway.base_url + "/v1/completions", json=body, timeout=10, trust_env=False)
    assert completion.status_code == 200 and [c["index"] for c in completion.json()["choices"]] == [0, 1]
    received = [
        r for sim in sim_gateway.sims for r in sim.received if r.headers.get("user-agent") != "tito-capabilities"
    ]
    assert sorted(r.path for r in received) == ["/inference/v1/generate", "/inference/v1/generate"]
    legs = [r.json() for r in received if r.path == "/inference/v1/generate"]
    assert len({leg["request_id"] for leg in legs}) == 2 and all(
        leg["sampling_params"]["max_tokens"] == 2 for leg in legs
    )


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b'{"model": "tiny", "messages": [', 400, 400),  # native's: see tests/e2e/test_bad_inputs.py
        (b'{"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]}', 404, 404),  # as vLLM
        (b'{"model": "tiny"}', 400, 400),  # native's validation error, from render
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', 400, 400),
    ],
    ids=["malformed-json", "unknown-model", "no-messages", "render-400-passed-through"],
)
def test_bad_requests_get_openai_errors_and_reach_no_engine(
    sim_gateway: SimGateway, body: bytes, status: int, code: object
) -> None:
    sim_gateway.reset()
    response = httpx.post(
        sim_gateway.base_url + "/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=10,
        trust_env=False,
    )
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert [r for sim in sim_gateway.sims for r in sim.received] == []


def test_fail_closed_when_engine_or_processor_is_down(stack: RunningStack, tmp_path: Path) -> None:
    gateway, servers = start_sim_gateway(stack, tmp_path, 1)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    url = gateway.base_url + "/v1/chat/completions"
    try:
        assert httpx.post(url, json=body, timeout=10, trust_env=False).status_code == 200
        servers[0].stop()  # engine gone: Envoy's 503 reaches the client as an OpenAI error
        down = httpx.post(url, json=body, timeout=10, trust_env=False)
        assert down.status_code == 503 and "error" in down.json()

        gateway.gateway.processes["processor"].stop()
        start = time.monotonic()
        closed = httpx.post(url, json=body, timeout=10, trust_env=False)
        elapsed = time.monotonic() - start
        assert closed.status_code == 503
        error = closed.json()["error"]
        # Envoy's own reply: a fixed type and message, no gRPC or exception details
        assert error == {
            "message": "the gateway could not complete the request",
            "type": "server_error",
            "param": None,
            "code": 503,
        }
        assert elapsed < 1.0, f"fail-closed answer took {elapsed:.2f}s"
        # the same reply under Anthropic's Messages, in its envelope
        anthropic = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
        closed = httpx.post(gateway.base_url + "/v1/messages", json=anthropic, timeout=10, trust_env=False)
        assert closed.status_code == 503
        assert closed.json() == {
            "type": "error",
            "error": {"type": "server_error", "message": "the gateway could not complete the request"},
        }
    finally:
        gateway.gateway.stop()
        for server in servers:
            server.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_reasoning_is_split_from_content_by_the_sidecar_parser(
    sim_gateway: SimGateway, stack: RunningStack, stream: bool
) -> None:
    from transformers import AutoTokenizer

    assert stack.config.model.reasoning_parser == "qwen3"
    tokenizer = AutoTokenizer.from_pretrained(stack.model_path)
    sim_gateway.reset()
    for sim in sim_gateway.sims:
        sim.tokens = tokenizer.encode("<think>pondering deeply</think>The answer is 4.")
    try:
        client = _client(sim_gateway.base_url)
        if stream:
            chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=64, stream=True))
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            content = "".join(d.content or "" for d in deltas)
            reasoning = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
        else:
            message = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=64).choices[0].message
            content, reasoning = message.content or "", getattr(message, "reasoning", None) or ""
    finally:
        for sim in sim_gateway.sims:
            sim.tokens = None
    assert (reasoning.strip(), content.strip()) == ("pondering deeply", "The answer is 4.")


def test_the_processor_reports_its_event_loop_lag(sim_gateway: SimGateway) -> None:
    """The loop every stream shares is watched: a timer's lateness, sampled continuously; it
    is uvloop unless `processor.event_loop` says otherwise."""
    time.sleep(0.3)
    lag = sim_gateway.state()["event_loop_lag"]
    assert lag["samples"] > 0 and 0 <= lag["p99_ms"] <= lag["max_ms"]
    assert lag["loop"] == sim_gateway.config.processor.event_loop == "uvloop"
    metrics = httpx.get(
        f"http://127.0.0.1:{sim_gateway.config.processor.admin_port}/metrics", timeout=5, trust_env=False
    ).text
    assert "tito_event_loop_lag_p99_ms " in metrics
