"""Capability negotiation on real CPU engines: `tito up` with one engine started with
`--enable-scale-out` and one without (`local.engines_without_scale_out`), as most existing
vLLM deployments run. From the first request, no client sees the plain engine's 403, no
breaker opens, the plain engine serves on its native endpoints and the other token-only (each
engine's own `/metrics` says which routes it served), answers equal native vLLM's, and
`tito engines` shows both records."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from ext_proc.tools.conformance.core import new_client
from ext_proc.tools.conformance.openai import run_case
from ext_proc.tools.conformance.openai_cases import CASES
from tests.conftest import RunningStack, free_port, gateway_config, scrape, tito_up

NATIVE_ROUTES = ("/v1/chat/completions", "/v1/completions")


@pytest.fixture(scope="module")
def mixed_engines(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    work = tmp_path_factory.mktemp("mixed")
    scale_out, plain = free_port(), free_port()
    config = gateway_config(
        work / "cache",
        free_port(),
        [],
        stack.model_path,
        pools=[{"name": "union", "role": "union", "instances": [{"port": scale_out}, {"port": plain}]}],
        model={**stack.config.model.model_dump(), "path": stack.model_path},
        scheduler={"policy": "round_robin"},  # both engines get every kind of request
        local={"engines_without_scale_out": [f"127.0.0.1:{plain}"]},
    )
    with tito_up(work, config) as running:
        yield running


def _served(url: str) -> dict[str, float]:
    """Successful POSTs per route, from the engine's own `http_requests_total`."""
    samples = scrape(url + "/metrics")
    counts: dict[str, float] = {}
    for (name, labels), value in samples.items():
        label = dict(labels)
        if name == "http_requests_total" and label.get("method") == "POST" and label.get("status") == "2xx":
            counts[label["handler"]] = counts.get(label["handler"], 0) + value
    return counts


def test_a_plain_engine_is_served_natively_and_the_other_token_only_from_the_first_request(
    mixed_engines: RunningStack,
) -> None:
    scale_out, plain = (i.url for i in mixed_engines.config.pools[0].instances)
    api = OpenAI(base_url=mixed_engines.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    before = {url: _served(url) for url in (scale_out, plain)}  # `tito up`'s smoke request went first
    # round robin alternates the engines: this order gives each both APIs, streaming and not
    for n, kind in enumerate(["chat", "completions", "completions", "chat"] * 2):
        if kind == "chat":
            messages = [{"role": "user", "content": "Hi"}]
            chat = api.chat.completions.create(model="tiny", messages=messages, max_tokens=4, stream=n > 3)
            assert list(chat) if n > 3 else chat.choices[0].finish_reason  # type: ignore[arg-type,union-attr]
        else:
            text = api.completions.create(model="tiny", prompt="Once upon", max_tokens=4, stream=n > 3)
            assert list(text) if n > 3 else text.choices[0].text  # type: ignore[arg-type,union-attr]

    def added(url: str, route: str) -> float:
        return _served(url).get(route, 0) - before[url].get(route, 0)

    assert added(scale_out, "/inference/v1/generate") == 4
    assert sum(added(scale_out, route) for route in NATIVE_ROUTES) == 0
    assert added(plain, "/inference/v1/generate") == 0
    assert added(plain, "/v1/chat/completions") == added(plain, "/v1/completions") == 2
    (state,) = mixed_engines.states()
    assert state["native_replays"] == 0  # no request learned it by failing
    assert {i["breaker"] for i in state["scheduler"]["instances"].values()} == {"closed"}
    records = state["capabilities"]["engines"]
    assert records[scale_out.removeprefix("http://")]["path"] == "token_only"
    assert records[plain.removeprefix("http://")]["token_only"] == "disabled"
    assert records[plain.removeprefix("http://")]["path"] == "native"


def test_answers_through_either_engine_equal_native_vllm(mixed_engines: RunningStack) -> None:
    """Round robin sends each case to the engines in turn: a token-only answer and a native
    one, each compared with the scale-out engine's own native answer."""
    native = mixed_engines.config.pools[0].instances[0].url
    failures = []
    with new_client() as client:
        for case in [c for c in CASES if c.spec.name in ("content", "reasoning")] * 2:
            result = run_case(case, mixed_engines.base_url, native, "tiny", client)
            if result.status != "PASS":
                failures.append(f"{result.status} {case.name}: {result.lines}")
    assert failures == []


def test_tito_engines_shows_both_records(mixed_engines: RunningStack, tmp_path: Path) -> None:
    config = tmp_path / "running.yaml"
    config.write_text((Path(mixed_engines.config.local.cache_dir) / "run" / "tito.yaml").read_text())
    out = subprocess.run(
        [sys.executable, "-m", "ext_proc.cli", "engines", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    scale_out, plain = (i.address for i in mixed_engines.config.pools[0].instances)
    lines = {line.split()[1]: line for line in out.splitlines()}
    assert "token-only generate live" in lines[scale_out] and lines[scale_out].endswith("-> routes token-only")
    assert "token-only generate disabled" in lines[plain] and lines[plain].endswith("-> routes natively")
    assert "vLLM 0.32.0, serves tiny" in lines[plain] and "tokenizer agrees" in lines[plain]
    render = mixed_engines.config.render_config.endpoint.address  # a render endpoint is named host:port
    assert lines[render + ":"].endswith("tokenizer agrees -> used")
    assert httpx.get(mixed_engines.admin_urls[0] + "/ready", timeout=5, trust_env=False).status_code == 200
