"""The product promise, case by case: for the same engine, seed and request, the gateway's
OpenAI answer equals the engine's native one (ext_proc/tools/conformance/), for each derender
mode. The first tests check the checker itself on made-up answers, so a difference in the
real runs cannot go unnoticed because the comparison is blind to it."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ext_proc.planning.refusals import ECHO_NEEDS_IN_PROCESS, IDS_NEED_IN_PROCESS
from ext_proc.tools.conformance import messages as messages_conformance
from ext_proc.tools.conformance import responses as responses_conformance
from ext_proc.tools.conformance.core import Answer, differences, new_client
from ext_proc.tools.conformance.messages import MessagesCase
from ext_proc.tools.conformance.openai import fetch, normalize_error, normalize_full, normalize_stream, run_case
from ext_proc.tools.conformance.openai_cases import CASES, SPECS, Case
from ext_proc.tools.conformance.responses import ResponsesCase
from tests.conftest import RealGateway, RunningStack, start_real_gateway

MODES = ("in_process", "sidecar")
# what vLLM 0.32's /derender cannot do (no echo; logprob tokens by text only): refused in that mode
_SIDECAR_REFUSES = {"echo": ECHO_NEEDS_IN_PROCESS, "return_tokens_as_token_ids": IDS_NEED_IN_PROCESS}


def _sse(*events: Any) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _chunk(delta: dict[str, Any], chunk_id: str = "chatcmpl-1", **choice: Any) -> dict[str, Any]:
    return {
        "id": chunk_id,
        "object": "chat.completion.chunk",
        "model": "tiny",
        "choices": [{"index": 0, "delta": delta, **choice}],
    }


def test_case_names_are_unique_and_every_spec_runs_in_its_modes() -> None:
    names = [case.name for case in CASES]
    assert len(names) == len(set(names)) == sum(len(spec.streams) for spec in SPECS)
    # streaming and not, but for a few (prompt logprobs; completions with beam search, which native never streams)
    assert sum(len(spec.streams) == 2 for spec in SPECS) > len(SPECS) - 8


def test_errors_are_answers_compared_by_status_and_error_object() -> None:
    error = {"message": "bad id", "type": "BadRequestError", "param": "logit_bias", "code": 400}
    full = normalize_error(400, json.dumps({"error": error}).encode())
    assert full.error is None and full.normalized == {"status": 400, "error": error}
    assert normalize_error(502, b"upstream connect error").error is not None  # no error object: no answer
    other = normalize_error(500, json.dumps({"error": {**error, "type": "InternalServerError"}}).encode())
    assert differences(other.normalized, full.normalized) == [
        "status: gateway 500 vs native 400",
        'error.type: gateway "InternalServerError" vs native "BadRequestError"',
    ]
    streamed = normalize_stream("chat", _sse({"error": error}, "[DONE]"))
    assert streamed.problems == [] and streamed.normalized["error"] == error
    late = normalize_stream("chat", _sse({"error": error}, _chunk({"content": "a"}), "[DONE]"))
    assert any("not the stream's last" in p for p in late.problems)


def test_echoed_prompt_logprobs_and_prompt_ids_are_compared() -> None:
    choice = {"index": 0, "text": "Hi there", "prompt_token_ids": [1, 2], "prompt_logprobs": [None, {"2": {}}]}
    body = {"object": "text_completion", "model": "tiny", "choices": [choice]}
    native = normalize_full("completions", body)
    gateway = normalize_full("completions", {**body, "choices": [{**choice, "prompt_logprobs": None}]})
    assert differences(gateway.normalized, native.normalized) == [
        'choices.0.prompt_logprobs: gateway null vs native [null, {"2": {}}]'
    ]


def test_stream_framing_violations_are_reported() -> None:
    raw = _sse(_chunk({"content": "a"}), _chunk({"content": "b"}, chunk_id="chatcmpl-2"), "[DONE]", "[DONE]")
    problems = normalize_stream("chat", raw).problems
    assert any("2 `data: [DONE]`" in p for p in problems)
    assert any("different chunk ids" in p for p in problems)
    wrong_object = _sse({**_chunk({"content": "a"}), "object": "chat.completion"}, "[DONE]")
    assert any("chunk object" in p for p in normalize_stream("chat", wrong_object).problems)
    assert any("[DONE]" in p for p in normalize_stream("chat", _sse(_chunk({"content": "a"}))).problems)


def test_stream_deltas_are_concatenated_and_tool_call_ids_only_need_to_be_stable() -> None:
    call = {"index": 0, "id": "call-a", "type": "function", "function": {"name": "get_weather", "arguments": '{"ci'}}
    more = {"index": 0, "function": {"arguments": 'ty": "東京 🗼"}'}}
    raw = _sse(
        _chunk({"role": "assistant", "reasoning": "hm"}),
        _chunk({"tool_calls": [call]}),
        _chunk({"tool_calls": [more]}, finish_reason="tool_calls"),
        "[DONE]",
    )
    choice = normalize_stream("chat", raw).choices[0]
    assert choice["reasoning"] == "hm" and choice["content"] is None and choice["finish_reason"] == "tool_calls"
    assert choice["tool_calls"] == [
        {"type": "function", "name": "get_weather", "arguments": {"city": "東京 🗼"}, "id": "present"}
    ]
    renamed = _sse(_chunk({"tool_calls": [call]}), _chunk({"tool_calls": [{**more, "id": "call-b"}]}), "[DONE]")
    assert normalize_stream("chat", renamed).choices[0]["tool_calls"][0]["id"] == "unstable (2 ids)"


def test_differences_name_the_field_and_ignore_ids_and_timestamps() -> None:
    def answer(finish: str, call_id: str, created: int) -> Answer:
        call = {"id": call_id, "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
        body = {
            "id": f"chatcmpl-{created}",
            "created": created,
            "object": "chat.completion",
            "model": "tiny",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        }
        return normalize_full("chat", body)

    native = answer("tool_calls", "chatcmpl-tool-1", 1)
    assert differences(answer("tool_calls", "x", 2).normalized, native.normalized) == []
    assert differences(answer("stop", "x", 2).normalized, native.normalized) == [
        'choices.0.finish_reason: gateway "stop" vs native "tool_calls"'
    ]


@pytest.fixture(scope="module")
def conformance_client() -> Iterator[httpx.Client]:
    with new_client() as client:
        yield client


def _gateway_url(mode: str, request: pytest.FixtureRequest) -> str:
    """in_process is `tito up`'s own gateway (the default mode); sidecar a second gateway."""
    if mode == "in_process":
        stack: RunningStack = request.getfixturevalue("stack")
        return stack.base_url
    return str(request.getfixturevalue("sidecar_gateway").base_url)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_gateway_answer_equals_native_vllm(
    case: Case, mode: str, stack: RunningStack, request: pytest.FixtureRequest, conformance_client: httpx.Client
) -> None:
    gateway_url = _gateway_url(mode, request)
    refused = next((field for field in _SIDECAR_REFUSES if case.spec.body.get(field)), None)
    if mode == "sidecar" and refused is not None:  # vLLM 0.32's /derender cannot: a clear 400
        answer = fetch(conformance_client, gateway_url, case, stack.config.model.served_name)
        assert answer.normalized == {
            "status": 400,
            "error": {
                "type": "invalid_request_error",
                "message": _SIDECAR_REFUSES[refused],
                "param": refused,
                "code": "unsupported_with_sidecar_derender",
            },
        }
        return
    result = run_case(case, gateway_url, stack.engine_url, stack.config.model.served_name, conformance_client)
    assert result.status == "PASS", f"{result.status} {case.name} ({mode}):\n" + "\n".join(result.lines)


@pytest.fixture(scope="module")
def coalesced_gateway(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealGateway]:
    """The stack's engine behind a gateway that asks it for 16 tokens per stream event and
    renders in process (vLLM's renderer in the processor, whose validated request derender
    then reads)."""
    work = tmp_path_factory.mktemp("coalescedgw")
    gateway = start_real_gateway(stack, work, derender={"stream_interval": 16}, render_config={"mode": "in_process"})
    yield gateway
    gateway.gateway.stop()


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_a_stream_of_16_tokens_per_engine_event_rendered_in_process_equals_native_vllm(
    case: Case, stack: RunningStack, coalesced_gateway: RealGateway, conformance_client: httpx.Client
) -> None:
    """Engine-side coalescing (`derender.stream_interval`) changes how many messages carry
    the answer, never the answer: the native side streams one token per event. Render in
    process changes where the request is rendered and validated, never the answer."""
    model = stack.config.model.served_name
    result = run_case(case, coalesced_gateway.base_url, stack.engine_url, model, conformance_client)
    assert result.status == "PASS", (
        f"{result.status} {case.name} (stream_interval 16, render in process):\n" + "\n".join(result.lines)
    )


# Anthropic Messages (chat inside the gateway) and OpenAI Responses (completions inside once
# rendered): converted at both ends as native converts them
MORE_APIS: dict[str, tuple[Any, MessagesCase | ResponsesCase]] = {
    **{case.name: (messages_conformance.run_case, case) for case in messages_conformance.CASES},
    **{case.name: (responses_conformance.run_case, case) for case in responses_conformance.CASES},
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(MORE_APIS))
def test_messages_and_responses_answers_equal_native_vllm(
    name: str, mode: str, stack: RunningStack, request: pytest.FixtureRequest, conformance_client: httpx.Client
) -> None:
    run, case = MORE_APIS[name]
    result = run(
        case, _gateway_url(mode, request), stack.engine_url, stack.config.model.served_name, conformance_client
    )
    assert result.status == "PASS", f"{result.status} {name} ({mode}):\n" + "\n".join(result.lines)


@pytest.mark.parametrize("name", ["text", "thinking", "tool-calls", "json-format"])
def test_the_official_openai_client_reads_responses_from_the_gateway_as_native(name: str, stack: RunningStack) -> None:
    """What the `openai` SDK's `responses` API makes of both answers, whole and streamed."""
    import openai

    spec = next(b for n, b, _ in responses_conformance.SPECS if n == name)
    sdk = {"input", "instructions", "max_output_tokens", "temperature", "tools", "tool_choice", "text"}
    body = {k: v for k, v in spec.items() if k in sdk}
    body["extra_body"] = {k: v for k, v in spec.items() if k not in sdk}  # vLLM's own fields
    model = stack.config.model.served_name

    def answers(base_url: str) -> list[dict[str, Any]]:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        whole = client.responses.create(model=model, **body)
        with client.responses.stream(model=model, **body) as stream:
            events = [event.type for event in stream]
            streamed = stream.get_final_response()
        assert events[0] == "response.created" and events[-1] == "response.completed"
        return [_sdk_response(whole), _sdk_response(streamed)]

    answers(stack.engine_url)  # the prompt cached: every answer below counts the same cache hits
    assert answers(stack.base_url) == answers(stack.engine_url)


def _sdk_response(response: Any) -> dict[str, Any]:
    """The SDK's response less its random values (ids, creation time)."""
    dumped: dict[str, Any] = response.model_dump(exclude={"id", "created_at"})
    for item in dumped["output"]:
        item.pop("id", None)
        item.pop("call_id", None)
    return dumped


@pytest.mark.parametrize("name", ["text", "thinking", "tool-named", "stop-sequence"])
def test_the_official_anthropic_client_reads_the_gateway_as_native(name: str, stack: RunningStack) -> None:
    """What the `anthropic` SDK makes of both answers, whole and streamed, is the same."""
    import anthropic

    spec = next(b for n, b, _ in messages_conformance.SPECS if n == name)
    sdk = {"max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences", "thinking", "output_config"}
    body = {k: v for k, v in spec.items() if k in sdk}
    # vLLM's own fields, and temperature (not a parameter of this SDK version)
    body["extra_body"] = {k: v for k, v in spec.items() if k not in sdk}
    model = stack.config.model.served_name

    def answers(base_url: str) -> list[dict[str, Any]]:
        client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
        whole = client.messages.create(model=model, **body)
        with client.messages.stream(model=model, **body) as stream:
            events = [event.type for event in stream]
            streamed = stream.get_final_message()
        assert events[0] == "message_start" and events[-1] == "message_stop"
        return [_sdk_message(whole), _sdk_message(streamed)]

    answers(stack.engine_url)  # the prompt cached: every answer below counts the same cache hits
    assert answers(stack.base_url) == answers(stack.engine_url)


def _sdk_message(message: Any) -> dict[str, Any]:
    """The SDK's message less its random values (id, thinking signatures, tool-use ids)."""
    dumped: dict[str, Any] = message.model_dump(exclude={"id"})
    for block in dumped["content"]:
        block.pop("signature", None)
        block.pop("id", None)
    return dumped


# A prompt of several KV blocks (128 tokens each): its answers count prefix-cache hits
_LONG = "Once upon a time a brave little robot crossed the river of stars. " * 24
_CACHED_USAGE: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": _LONG}], "max_tokens": 3}),
    "completions": ("/v1/completions", {"prompt": _LONG, "max_tokens": 3}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": _LONG}], "max_tokens": 3}),
    "responses": ("/v1/responses", {"input": _LONG, "max_output_tokens": 3}),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", list(_CACHED_USAGE))
def test_prefix_cache_hits_are_reported_as_native_reports_them(
    api: str, stream: bool, mode: str, stack: RunningStack, request: pytest.FixtureRequest
) -> None:
    """The engines run with `--enable-prompt-tokens-details`: in the same cache state (the
    prompt seen once before), the gateway's usage equals native's, cached tokens included."""
    path, body = _CACHED_USAGE[api]
    body = {**body, "model": stack.config.model.served_name, "temperature": 0.0, "stream": stream}
    if stream and api in ("chat", "completions"):
        body["stream_options"] = {"include_usage": True}
    httpx.post(stack.engine_url + path, json=body, timeout=60).raise_for_status()  # the prompt cached
    native = _final_usage(stack.engine_url + path, body)
    assert native == _final_usage(_gateway_url(mode, request) + path, body)
    cached = {
        "chat": lambda u: u["prompt_tokens_details"]["cached_tokens"],
        "completions": lambda u: u["prompt_tokens_details"]["cached_tokens"],
        "messages": lambda u: u["cache_read_input_tokens"],
        "responses": lambda u: u["input_tokens_details"]["cached_tokens"],
    }[api](native)
    assert cached >= 128, native


def _final_usage(url: str, body: dict[str, Any]) -> Any:
    """The usage of a whole answer, or of a stream's last event that carries one."""
    if not body["stream"]:
        answer = httpx.post(url, json=body, timeout=60)
        answer.raise_for_status()
        return answer.json()["usage"]
    usage = None
    with httpx.stream("POST", url, json=body, timeout=60) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[len("data: ") :])
            if data.get("type") == "message_start":  # Anthropic: the counts so far, then more
                usage = data["message"]["usage"]
            elif data.get("type") == "message_delta":
                usage = {**usage, **data["usage"]}
            else:
                usage = data.get("usage") or (data.get("response") or {}).get("usage") or usage
    return usage


# where each API reports a prompt's cache counts, and its cache writes among them
_PROMPT_DETAILS = {
    "chat": (lambda u: u["prompt_tokens_details"], "created_cache_tokens"),
    "messages": (lambda u: {k: v for k, v in u.items() if k.startswith("cache_")}, "cache_creation_input_tokens"),
    "responses": (lambda u: u["input_tokens_details"], "cache_write_tokens"),
}


@pytest.mark.parametrize("api", list(_PROMPT_DETAILS))
def test_a_new_prompt_reports_the_blocks_its_prefill_wrote(api: str, stack: RunningStack) -> None:
    """Cache writes are counted by the engine and not reported by generate; the gateway counts
    them as the engine does (the prompt's full blocks less its hits). Two new prompts (a
    random number first), one to each side, of about one length: the counts are compared,
    not the lengths (Messages' input_tokens is the prompt less them)."""
    path, body = _CACHED_USAGE[api]
    read, written = _PROMPT_DETAILS[api]
    details = []
    for url in (stack.engine_url, stack.base_url):
        fresh = f"Story {secrets.randbelow(10**8):08d}: " + _LONG
        asked = json.loads(json.dumps(body).replace(json.dumps(_LONG), json.dumps(fresh)))
        asked |= {"model": stack.config.model.served_name, "temperature": 0.0}
        details.append(read(_final_usage(url + path, {**asked, "stream": False})))
    assert details[0] == details[1]
    assert details[0][written] >= 128, details
