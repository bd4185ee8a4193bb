"""Token obfuscation on a real CPU vLLM engine serving vocabulary-permuted weights: `tito up`
with `local.permute_engine_weights` gives its engine a copy of the tiny model permuted by the
gateway's own permutation (`ext_proc/tools/obfuscated_model.py`) while render keeps the plain
model. Greedy variants of the conformance cases then equal the plain engine's native answers
field by field (the sampled cases cannot: a seeded sampler draws per vocabulary index, and the
permuted engine's indices are others), the engine logs only physical ids, and the same
permuted engine behind a gateway with obfuscation off gives other text (the negative control).

Logprobs equal native's to float32 rounding, not bit for bit: the softmax sums the same
logits in another (permuted) order."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from ext_proc.config import Endpoint
from ext_proc.obfuscation import build_codec
from ext_proc.tools.conformance.core import MAX_REPORTED, Answer, compared, new_client, unexercised
from ext_proc.tools.conformance.openai import fetch
from ext_proc.tools.conformance.openai_cases import SPECS, Case
from tests.conftest import RunningStack, free_port, gateway_config, start_real_gateway, tito_up

SECRET = "correct horse battery staple q7zx"
# The conformance cases whose feature shows greedily: chat and completions, tool calls forced
# by structured outputs, stop strings, logit_bias, logprobs with top logprobs (by text and by
# id), echoed and prompt logprobs, JSON and regex outputs, CJK and emoji, two choices, usage,
# beam search (EOS and the steps' candidates in physical ids, the beams' text in semantic ones).
GREEDY = {
    "content",
    "reasoning-content",
    "tool-auto",
    "tool-several",
    "tool-non-ascii",
    "stop",
    "logprobs",
    "logprobs-as-ids",
    "json",
    "regex",
    "cjk-emoji",
    "n2",
    "usage",
    "echo-logprobs",
    "prompt-logprobs",
    "beam-search-logprobs",
}
CASES = [
    Case(replace(spec, body={**spec.body, "temperature": 0.0}), stream)
    for spec in SPECS
    if spec.name in GREEDY
    for stream in spec.streams
]
FORCED = {"tool-auto", "tool-non-ascii", "logprobs", "logprobs-as-ids"}  # their feature shows greedily too


@pytest.fixture(scope="module")
def permuted(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    """`tito up` over the permuted copy of the stack's model, its engine logging each request's ids."""
    work = tmp_path_factory.mktemp("permuted")
    (work / "secret").write_text(SECRET)
    config = gateway_config(
        work / "cache",
        free_port(),
        [Endpoint(port=free_port())],
        stack.model_path,
        model={**stack.config.model.model_dump(), "path": stack.model_path},
        obfuscation={"enable": True, "secret_file": str(work / "secret")},
        local={
            "permute_engine_weights": True,
            "engine_extra_args": ["--enable-log-requests", "--log-level", "DEBUG"],
        },
    )
    with tito_up(work, config) as running:
        yield running


def test_the_greedy_cases_show_what_they_check() -> None:
    """A test that cannot fail is a defect: the list covers what issue 33 names."""
    names = {(case.api, case.spec.name) for case in CASES}
    assert {("chat", "tool-several"), ("chat", "stop"), ("completions", "stop"), ("chat", "logprobs")} <= names
    assert {("completions", "logprobs-as-ids"), ("chat", "reasoning-content")} <= names  # ids out, logit_bias in
    assert all(case.stream in (False, True) for case in CASES) and len({c.stream for c in CASES}) == 2


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case.name}-greedy")
def test_a_greedy_answer_over_permuted_weights_equals_the_plain_engines_native_one(
    case: Case, permuted: RunningStack, stack: RunningStack
) -> None:
    model = stack.config.model.served_name
    with new_client() as client:
        native = fetch(client, stack.engine_url, case, model)
        gateway = fetch(client, permuted.base_url, case, model)
    assert native.error is None and not native.problems, native.error or native.problems
    if case.spec.name in FORCED:
        assert unexercised(case.spec.expect, native) == []
    result = compared(case.name, _comparable(gateway, native), _comparable(native, native), MAX_REPORTED)
    if result.status != "PASS":  # native asked once more, as the conformance harness does (native_then_gateway)
        with new_client() as client:
            again = fetch(client, stack.engine_url, case, model)
        result = compared(case.name, _comparable(gateway, again), _comparable(again, again), MAX_REPORTED)
    assert result.status == "PASS", f"{result.status} {case.name}:\n" + "\n".join(result.lines)


def _comparable(answer: Answer, native: Answer) -> Answer:
    """`answer` with each float that equals native's to float32 rounding set to native's, and
    without the prefix-cache counts and `system_fingerprint` (two engines, two caches, two
    configs: test_conformance.py compares those); every other difference stays for the
    comparison to report."""
    normalized = {k: v for k, v in _snapped(answer.normalized, native.normalized).items() if k != "system_fingerprint"}
    if isinstance(normalized.get("usage"), dict):
        normalized["usage"] = {k: v for k, v in normalized["usage"].items() if k != "prompt_tokens_details"}
    return replace(answer, normalized=normalized)


def _snapped(gateway: Any, native: Any) -> Any:
    if isinstance(gateway, float) and isinstance(native, float):
        return native if math.isclose(gateway, native, rel_tol=1e-5, abs_tol=1e-5) else gateway
    if isinstance(gateway, dict) and isinstance(native, dict):
        return {k: _snapped(v, native.get(k)) for k, v in gateway.items()}
    if isinstance(gateway, list) and isinstance(native, list) and len(gateway) == len(native):
        return [_snapped(g, n) for g, n in zip(gateway, native, strict=True)]
    return gateway


PROMPT = "The capital of France is"


def _greedy_ids(stack: RunningStack, **body: Any) -> list[int]:
    asked = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}
    answer = httpx.post(stack.engine_url + "/v1/completions", json={**asked, **body}, timeout=60)
    return list(answer.json()["choices"][0]["token_ids"])


def _id_fields(plain: list[int]) -> dict[str, dict[str, Any]]:
    """Requests whose answers hinge on ids the gateway must send physical."""
    return {
        "stop_token_ids": {"stop_token_ids": [plain[3]]},
        "allowed_token_ids": {"allowed_token_ids": sorted({plain[1], plain[4], 13, 42})},
        "logit_bias": {"logit_bias": {str(plain[5]): 100}},
    }


@pytest.mark.parametrize("field", ["stop_token_ids", "allowed_token_ids", "logit_bias"])
def test_id_fields_reach_the_permuted_engine_as_physical_ids(
    field: str, permuted: RunningStack, stack: RunningStack
) -> None:
    """Each answer equals the plain engine's native one and shows the field's effect."""
    plain = _greedy_ids(stack)
    extra = _id_fields(plain)[field]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True, **extra}
    native = httpx.post(stack.engine_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    gateway = httpx.post(permuted.base_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    keys = ("text", "token_ids", "finish_reason", "stop_reason")
    assert {k: gateway[k] for k in keys} == {k: native[k] for k in keys}
    shown = {
        "stop_token_ids": native["stop_reason"] == plain[3] and len(native["token_ids"]) <= plain.index(plain[3]) + 1,
        "allowed_token_ids": set(native["token_ids"]) <= set(extra.get("allowed_token_ids", [])),
        "logit_bias": native["token_ids"] == [plain[5]] * 8,
    }[field]
    assert shown, native


def test_the_engine_logs_only_physical_ids(permuted: RunningStack, stack: RunningStack) -> None:
    """The engine's request log (prompt ids at DEBUG, sampling parameters at INFO) holds the
    physical ids of the prompt and of a stop id, never the semantic ones."""
    prompt = "Obfuscated: 東京 🐉 the quick brown fox"
    stop = _greedy_ids(stack)[3]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0.0, "stop_token_ids": [stop]}
    assert httpx.post(permuted.base_url + "/v1/completions", json=body, timeout=60).status_code == 200
    rendered = httpx.post(stack.config.render_config.endpoint.url + "/v1/completions/render", json=body, timeout=60)
    ids = rendered.json()[0]["token_ids"]
    codec = build_codec(permuted.config)
    assert codec is not None
    physical, physical_stop = codec.physical_ids(ids), codec.physical_ids([stop])[0]
    assert physical != ids and physical_stop != stop
    log = "\n".join(path.read_text(errors="replace") for path in _engine_logs(permuted))
    logged = [[int(i) for i in re.findall(r"\d+", m)] for m in re.findall(r"prompt_token_ids: \[([\d, ]+)\]", log)]
    assert physical in logged, log[-3000:]
    assert ids not in logged
    stops = [int(i) for m in re.findall(r"stop_token_ids=\[([\d, ]*)\]", log) for i in re.findall(r"\d+", m)]
    assert physical_stop in stops and stop not in stops, stops


def test_plain_ids_to_the_permuted_engine_give_other_text(
    permuted: RunningStack, stack: RunningStack, tmp_path: Path
) -> None:
    """The negative control: obfuscation off in front of the same permuted engine (capability
    negotiation off too: its tokenizer canary would hold such an engine out)."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0}
    native = httpx.post(stack.engine_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    obfuscated = httpx.post(permuted.base_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert obfuscated["text"] == native
    plain = start_real_gateway(permuted, tmp_path, obfuscation={"enable": False}, capabilities={"enable": False})
    try:
        text = httpx.post(plain.base_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    finally:
        plain.gateway.stop()
    assert text != native


def _engine_logs(running: RunningStack) -> list[Path]:
    return sorted((Path(running.config.local.cache_dir) / "run" / "logs").glob("engine*.log"))
