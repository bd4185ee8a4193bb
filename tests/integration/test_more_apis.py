"""Anthropic Messages and OpenAI Responses through real Envoy and the real render sidecar, over
engine simulators, with the official `anthropic` and `openai` clients: a Messages request is a
chat request inside the gateway, a Responses request a completions request once rendered, so
admission, prefix affinity and relay apply to them as to chat and completions, and what they
refuse comes in their API's envelope. (Equality with native vLLM's `/v1/messages` and
`/v1/responses`, on a real engine: `tests/e2e/test_conformance.py`.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import RunningStack, SimGateway, leak_checked, metric, running_sim_gateway
from tests.engine_sim import Fault

BUDGET = 1500  # tokens: every request fits, except the one meant not to
SYSTEM = " ".join(f"Rule {n}: answer politely, cite sources, and keep the tone friendly 你好." for n in range(12))


@pytest.fixture(scope="module")
def messages_gateway(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimGateway]:
    with running_sim_gateway(
        stack,
        tmp_path_factory.mktemp("messages"),
        3,
        admission={"global_token_budget": BUDGET},
        scheduler={"policy": "kv_cache_affinity", "breaker": {"failure_threshold": 1000}},
        reschedule={"enable": True, "first_token_timeout_s": 2.0, "inter_token_timeout_s": 1.0},
        logging={"format": "json"},
    ) as gateway:
        yield gateway


@pytest.fixture
def gw(messages_gateway: SimGateway) -> Iterator[SimGateway]:
    yield from leak_checked(messages_gateway)


def _client(gw: SimGateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=30)


def _ask(user: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": max_tokens, "messages": [{"role": "user", "content": user}], **extra}


def test_a_shared_system_prompt_lands_where_it_was_served(gw: SimGateway) -> None:
    client = _client(gw)
    for n in range(5):  # one after the other: no load anywhere, only the cache differs
        message = client.messages.create(**_ask(f"question {n}?", system=SYSTEM))
        assert message.type == "message" and message.usage.output_tokens == 8
    landed = [n for n, sim in enumerate(gw.sims) for _ in sim.generate_requests()]
    assert len(landed) == 5 and len(set(landed)) == 1, landed


def test_admission_refuses_beyond_the_budget_in_anthropics_envelope(gw: SimGateway) -> None:
    with pytest.raises(anthropic.RateLimitError) as refused:
        _client(gw).messages.create(**_ask("hello", max_tokens=BUDGET))
    assert refused.value.status_code == 429
    assert refused.value.body == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": refused.value.body["error"]["message"]},
    }
    assert all(sim.generate_requests() == [] for sim in gw.sims)
    state = gw.state()
    assert state["scheduler"]["total_active_tokens"] == 0


def test_a_stream_relayed_to_another_engine_is_one_whole_messages_stream(gw: SimGateway) -> None:
    fault = Fault("abort", after_tokens=5, times=1)  # the first engine stream, wherever it goes
    for sim in gw.sims:
        sim.fault = fault
    relays = metric(gw.metrics(), "tito_relays_total")
    with _client(gw).messages.stream(**_ask("relay me", max_tokens=16)) as stream:
        events = [event.type for event in stream]
        message = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop" and "error" not in events
    calls = sorted(
        ((sim.address, r.json()["token_ids"]) for sim in gw.sims for r in sim.generate_requests()),
        key=lambda c: len(c[1]),
    )
    assert len(calls) == 2 and calls[0][0] != calls[1][0]
    assert metric(gw.metrics(), "tito_relays_total") == relays + 1
    assert message.usage.output_tokens == 16 and message.stop_reason == "max_tokens"
    # the answer is what one engine emitting those 16 ids gives, whole
    (_, prompt), (_, continued) = calls
    ids = continued[len(prompt) :] + gw.sims[0].script(continued, 11)
    for sim in gw.sims:
        sim.tokens, sim.fault = ids, None
    whole = _client(gw).messages.create(**_ask("relay me", max_tokens=16))
    assert [b.model_dump(exclude={"signature"}) for b in whole.content] == [
        b.model_dump(exclude={"signature"}) for b in message.content
    ]


def test_errors_native_answers_before_and_inside_its_route(gw: SimGateway) -> None:
    url = gw.base_url + "/v1/messages"
    missing_max_tokens = httpx.post(url, json={"model": "tiny", "messages": []}, timeout=10, trust_env=False)
    assert missing_max_tokens.status_code == 400
    assert "max_tokens" in missing_max_tokens.json()["error"]["message"]  # FastAPI's validation, before the route
    with pytest.raises(anthropic.NotFoundError) as unknown:
        _client(gw).messages.create(**{**_ask("hi"), "model": "no-such-model"})
    assert unknown.value.body["type"] == "error" and "no-such-model" in unknown.value.body["error"]["message"]
    count = _client(gw).messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert count.input_tokens > 3
    assert all(sim.generate_requests() == [] for sim in gw.sims)


TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALLS = "".join(
    f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>\n'
    for city in ("Paris", "東京 🗼")
)


def test_scripted_tool_calls_are_tool_use_blocks_whole_and_streamed(gw: SimGateway, stack: RunningStack) -> None:
    """Two complete calls (a random-weight real engine never completes one greedily): the
    hermes parser makes chat tool calls, vLLM's converters make them tool_use blocks."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stack.model_path)
    for sim in gw.sims:
        sim.tokens, sim.finish_reason = [int(t) for t in tokenizer.encode(CALLS + "<|im_end|>")], "stop"
    body = _ask(
        "weather?", max_tokens=200, tools=[TOOL], extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    whole = _client(gw).messages.create(**body)
    with _client(gw).messages.stream(**body) as stream:
        kinds = [(event.type, getattr(getattr(event, "delta", None), "type", None)) for event in stream]
        streamed = stream.get_final_message()
    for message in (whole, streamed):
        assert message.stop_reason == "tool_use"
        assert [(b.type, b.name, b.input) for b in message.content] == [  # type: ignore[union-attr]
            ("tool_use", "get_weather", {"city": "Paris"}),
            ("tool_use", "get_weather", {"city": "東京 🗼"}),
        ]
    assert ("content_block_delta", "input_json_delta") in kinds


# -- OpenAI Responses ------------------------------------------------------------------------


def _responses(gw: SimGateway) -> Any:
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0, timeout=30).responses


def test_responses_share_prefix_affinity(gw: SimGateway) -> None:
    for n in range(5):  # one after the other: no load anywhere, only the cache differs
        response = _responses(gw).create(model="tiny", instructions=SYSTEM, input=f"question {n}?", max_output_tokens=8)
        assert response.status == "incomplete" and response.usage is not None and response.usage.output_tokens == 8
    landed = [n for n, sim in enumerate(gw.sims) for _ in sim.generate_requests()]
    assert len(landed) == 5 and len(set(landed)) == 1, landed


def test_responses_admission_refuses_beyond_the_budget(gw: SimGateway) -> None:
    with pytest.raises(openai.RateLimitError) as refused:
        _responses(gw).create(model="tiny", input="hello", max_output_tokens=BUDGET)
    assert refused.value.status_code == 429
    assert all(sim.generate_requests() == [] for sim in gw.sims)
    assert gw.state()["scheduler"]["total_active_tokens"] == 0


def test_a_responses_stream_relayed_to_another_engine_is_one_whole_stream(gw: SimGateway) -> None:
    fault = Fault("abort", after_tokens=5, times=1)  # the first engine stream, wherever it goes
    for sim in gw.sims:
        sim.fault = fault
    relays = metric(gw.metrics(), "tito_relays_total")
    body = {"model": "tiny", "input": "relay me", "max_output_tokens": 16}
    with _responses(gw).stream(**body) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert events[0] == "response.created" and events[-1] == "response.completed" and "error" not in events
    calls = sorted(
        ((sim.address, r.json()["token_ids"]) for sim in gw.sims for r in sim.generate_requests()),
        key=lambda c: len(c[1]),
    )
    assert len(calls) == 2 and calls[0][0] != calls[1][0]
    assert metric(gw.metrics(), "tito_relays_total") == relays + 1
    assert streamed.usage is not None and streamed.usage.output_tokens == 16 and streamed.status == "incomplete"
    # the answer is what one engine emitting those 16 ids gives, whole
    (_, prompt), (_, continued) = calls
    ids = continued[len(prompt) :] + gw.sims[0].script(continued, 11)
    for sim in gw.sims:
        sim.tokens, sim.fault = ids, None
    whole = _responses(gw).create(**body)
    assert whole.output_text == streamed.output_text and whole.usage == streamed.usage
    # the relayed stream's answer was kept as the client got it (a processor-owned stream)
    kept = _responses(gw).retrieve(streamed.id)
    assert (kept.id, kept.output_text, kept.usage, kept.status) == (
        streamed.id,
        streamed.output_text,
        streamed.usage,
        streamed.status,
    )


def test_responses_refuse_what_needs_a_store_as_native_does(gw: SimGateway) -> None:
    url = gw.base_url + "/v1/responses"
    previous = httpx.post(url, json={"model": "tiny", "input": "hi", "previous_response_id": "resp_1"}, timeout=10)
    assert previous.status_code == 404
    assert previous.json()["error"]["message"] == "Response with id 'resp_1' not found."
    background = httpx.post(url, json={"model": "tiny", "input": "hi", "background": True}, timeout=10)
    assert background.status_code == 400 and background.json()["error"]["param"] == "background"
    with pytest.raises(openai.NotFoundError):
        _responses(gw).create(model="no-such-model", input="hi")
    assert httpx.get(url + "/resp_1", timeout=10).status_code == 404
    assert all(sim.generate_requests() == [] for sim in gw.sims)


def test_scripted_tool_calls_are_function_call_items_whole_and_streamed(gw: SimGateway, stack: RunningStack) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stack.model_path)
    for sim in gw.sims:
        sim.tokens, sim.finish_reason = [int(t) for t in tokenizer.encode(CALLS + "<|im_end|>")], "stop"
    tool = {"type": "function", "name": "get_weather", "parameters": TOOL["input_schema"]}
    body = {
        "model": "tiny",
        "input": "weather?",
        "max_output_tokens": 200,
        "tools": [tool],
        "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
    }
    whole = _responses(gw).create(**body)
    with _responses(gw).stream(**body) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    for response in (whole, streamed):
        calls = [(item.type, item.name, item.arguments) for item in response.output]  # type: ignore[union-attr]
        assert [(t, n, json.loads(a)) for t, n, a in calls] == [
            ("function_call", "get_weather", {"city": "Paris"}),
            ("function_call", "get_weather", {"city": "東京 🗼"}),
        ]
    assert "response.function_call_arguments.delta" in kinds


def test_responses_output_logprobs_are_the_engines_whole_and_streamed(gw: SimGateway) -> None:
    body: dict[str, Any] = {
        "model": "tiny",
        "input": "logprobs?",
        "max_output_tokens": 6,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
        "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
    }
    whole = _responses(gw).create(**body)
    with _responses(gw).stream(**body) as stream:
        deltas = [event.logprobs for event in stream if event.type == "response.output_text.delta"]
        streamed = stream.get_final_response()
    # native Responses shows the first k candidates, as chat: the engine is asked for the client's k
    asked = [r.json()["sampling_params"]["logprobs"] for sim in gw.sims for r in sim.generate_requests()]
    assert asked == [2, 2]
    for response in (whole, streamed):
        [part] = response.output[0].content  # type: ignore[union-attr]
        assert part.logprobs is not None and len(part.logprobs) == 6
        assert all(len(p.top_logprobs) == 2 for p in part.logprobs)
    assert whole.output[0].content[0].logprobs == streamed.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert [(p.token, p.logprob) for d in deltas for p in d] == [
        (p.token, p.logprob)
        for p in streamed.output[0].content[0].logprobs  # type: ignore[union-attr]
    ]
