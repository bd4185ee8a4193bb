"""Multi-model routing and LoRA adapters through Envoy, the real render sidecar and engine
simulators that serve adapters (RFC 多模型路由): the gateway's /v1/models is the union of the
engines' lists; an adapter's request is rendered as its base and generated under its own
name, only where an engine lists it; an alias is the base; a request for an adapter no engine
lists is loaded once on the instance chosen (`lora.on_missing: load`); requests for three
adapters over three instances with `max_loras: 1` settle one adapter per instance."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import RunningStack, SimGateway, leak_checked, running_sim_gateway

CHAT = {"messages": [{"role": "user", "content": "Which adapter answers?"}], "max_tokens": 6}
CATALOG = {"aliases": ["tiny-latest"], "adapters": [{"name": "sql", "path": "/adapters/sql"}]}


@pytest.fixture(scope="module")
def lora(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimGateway]:
    with running_sim_gateway(
        stack,
        tmp_path_factory.mktemp("lora"),
        3,
        model=CATALOG,
        lora={"on_missing": "load", "max_loras": 1, "spread_requests": 3},
        capabilities={"interval_s": 0.5},  # adapters an engine lists join its record quickly
    ) as gateway:
        yield gateway


@pytest.fixture
def gw(lora: SimGateway) -> Iterator[SimGateway]:
    yield from leak_checked(lora)
    for sim in lora.sims:
        sim.adapters.clear()
        sim.loaded.clear()
    _wait_registered(lora, {sim.address: [] for sim in lora.sims})


def _wait_registered(gateway: SimGateway, expected: dict[str, list[str]]) -> None:
    """Until the gateway's records list what each engine serves."""
    deadline = time.monotonic() + 10
    while True:
        instances = gateway.state()["scheduler"]["instances"]
        listed = {address: instances[address]["adapters"]["registered"] for address in expected}
        if listed == expected:
            return
        assert time.monotonic() < deadline, listed
        time.sleep(0.1)


def _chat(gateway: SimGateway, model: str, **extra: Any) -> httpx.Response:
    body = {**CHAT, "model": model, **extra}
    return httpx.post(gateway.base_url + "/v1/chat/completions", json=body, timeout=30, trust_env=False)


def _generated(gateway: SimGateway) -> dict[str, list[str | None]]:
    """Per engine, the `model` of each token-only generate it got (the gateway's probes aside)."""
    return {
        sim.address: [
            r.json().get("model") for r in sim.generate_requests() if r.headers.get("user-agent") != "tito-capabilities"
        ]
        for sim in gateway.sims
    }


def test_models_lists_the_bases_and_every_adapter_the_engines_serve(gw: SimGateway) -> None:
    gw.sims[0].adapters["chat-ft"] = "/mnt/chat-ft"
    gw.sims[2].adapters["summarize"] = "/mnt/summarize"
    _wait_registered(gw, {gw.sims[0].address: ["chat-ft"], gw.sims[2].address: ["summarize"]})
    models = httpx.get(gw.base_url + "/v1/models", timeout=10, trust_env=False).json()
    assert [(m["id"], m["parent"], m["root"]) for m in models["data"]] == [
        ("tiny", None, "/sim/tiny"),
        ("tiny-latest", None, gw.config.model.path),  # an alias only the gateway serves
        ("chat-ft", "tiny", "/mnt/chat-ft"),
        ("summarize", "tiny", "/mnt/summarize"),
        ("sql", "tiny", "/adapters/sql"),  # configured: loaded where it is first asked for
    ]


def test_an_adapter_is_served_only_where_it_is_listed_under_its_own_name(gw: SimGateway) -> None:
    gw.sims[1].adapters["chat-ft"] = "/mnt/chat-ft"
    _wait_registered(gw, {gw.sims[1].address: ["chat-ft"]})
    base = _chat(gw, "tiny").json()
    adapted = [_chat(gw, "chat-ft").json() for _ in range(3)]
    assert {a["model"] for a in adapted} == {"chat-ft"}  # native vLLM names the adapter
    assert adapted[0]["choices"][0]["message"] != base["choices"][0]["message"]  # the adapter was applied
    stream = httpx.post(
        gw.base_url + "/v1/chat/completions",
        json={**CHAT, "model": "chat-ft", "stream": True},
        timeout=30,
        trust_env=False,
    )
    chunks = [orjson.loads(e[6:]) for e in stream.text.split("\n\n") if e.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {"chat-ft"}
    generated = _generated(gw)
    assert generated[gw.sims[1].address].count("chat-ft") == 4
    assert all("chat-ft" not in generated[sim.address] for sim in (gw.sims[0], gw.sims[2]))


def test_an_alias_is_the_base_and_an_unknown_model_is_natives_404(gw: SimGateway) -> None:
    alias = _chat(gw, "tiny-latest")
    assert alias.status_code == 200 and alias.json()["model"] == "tiny"  # as vLLM answers an alias
    assert alias.json()["choices"] == _chat(gw, "tiny").json()["choices"]
    unknown = _chat(gw, "gpt-5")
    assert unknown.status_code == 404
    assert unknown.json() == {
        "error": {
            "message": "The model `gpt-5` does not exist. Valid aliases: tiny, tiny-latest.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    assert all(model != "gpt-5" for models in _generated(gw).values() for model in models)


def test_an_adapter_no_engine_lists_is_loaded_once_where_it_goes(gw: SimGateway) -> None:
    # as many at once as one instance takes before a hot adapter spreads (spread_requests: a
    # fourth in flight together may go to, and load on, a second instance, as it should)
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: answers.append(_chat(gw, "sql"))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert [a.status_code for a in answers] == [200] * 3 and {a.json()["model"] for a in answers} == {"sql"}
    loaded = [sim for sim in gw.sims if sim.loaded]
    assert len(loaded) == 1 and loaded[0].loaded == ["sql"]  # one load, on one instance
    assert _generated(gw)[loaded[0].address] == ["sql"] * 3


def _streams(gw: SimGateway, requests: list[tuple[str, int]], gap_s: float) -> None:
    """Streaming chats (model, max_tokens), started `gap_s` apart, all read to the end."""

    def stream(model: str, max_tokens: int) -> None:
        body = {**CHAT, "model": model, "max_tokens": max_tokens, "stream": True}
        with httpx.stream("POST", gw.base_url + "/v1/chat/completions", json=body, timeout=60, trust_env=False) as r:
            assert r.status_code == 200
            r.read()

    threads = [threading.Thread(target=stream, args=request) for request in requests]
    for thread in threads:
        thread.start()
        time.sleep(gap_s)
    for thread in threads:
        thread.join(60)


def test_a_hot_adapter_spreads_to_instances_with_a_free_slot(gw: SimGateway) -> None:
    for sim in gw.sims:
        sim.adapters["hot"] = "/mnt/hot"
        sim.token_delay_s = 0.02
    _wait_registered(gw, {sim.address: ["hot"] for sim in gw.sims})
    _streams(gw, [("hot", 40)] * 6, 0.05)  # at spread_requests (3) in flight, the next goes elsewhere
    served = sorted(len(models) for models in _generated(gw).values())
    assert served == [0, 3, 3], served


def test_three_adapters_over_three_instances_settle_one_per_instance(gw: SimGateway) -> None:
    for sim in gw.sims:
        sim.adapters.update({"a": "/mnt/a", "b": "/mnt/b", "c": "/mnt/c"})
        sim.token_delay_s = 0.02  # requests overlap as a steady stream would
    _wait_registered(gw, {sim.address: ["a", "b", "c"] for sim in gw.sims})

    # one long stream per adapter, then a burst of short ones
    _streams(gw, [(model, 60) for model in "abc"] + [("abc"[n % 3], 8) for n in range(12)], 0.07)
    homes = {address: set(models) for address, models in _generated(gw).items()}
    assert sorted(len(models) for models in homes.values()) == [1, 1, 1], homes  # max_loras 1 each
    assert set.union(*homes.values()) == {"a", "b", "c"}
