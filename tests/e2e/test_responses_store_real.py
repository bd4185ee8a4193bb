"""Stored OpenAI Responses through the gateway against native vLLM with its own store
(`VLLM_ENABLE_RESPONSES_API_STORE=1`, which `tito up` sets on its engines while the gateway's
store is on): chains of turns by `previous_response_id`, whole and streamed, equal field by
field (ids and timestamps aside); retrieve and cancel as native answers them; delete and
`input_items` as OpenAI's API reference defines them (native vLLM has neither)."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from ext_proc.tools.conformance.openai_cases import ENGLISH, NO_THINK, hermes_tool_call_regex
from ext_proc.tools.conformance.responses import TOOL, normalize_response, normalize_stream
from tests.conftest import RunningStack

GREEDY = {"temperature": 0.0}
FORCED_CALL = {"structured_outputs": {"regex": hermes_tool_call_regex("Paris")}, "tools": [TOOL], **NO_THINK}
# Each chain: the turns' bodies after the first's, each continuing the one before.
CHAINS: dict[str, list[dict[str, Any]]] = {
    "text": [
        {"input": ENGLISH, "max_output_tokens": 8, "instructions": "You are terse.", **NO_THINK},
        {"input": "And then?", "max_output_tokens": 8, **NO_THINK},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "The end?"}]}], "max_output_tokens": 6},
    ],
    "tool-call": [
        {"input": "What is the weather in Paris?", "max_output_tokens": 120, **FORCED_CALL},
        {"input": "<call output>", "max_output_tokens": 10, "tools": [TOOL], **NO_THINK},
        {"input": "Thanks. And tomorrow?", "max_output_tokens": 8, "tools": [TOOL], **NO_THINK},
    ],
    "reasoning": [
        {"input": ENGLISH, "max_output_tokens": 12},
        {"input": "Go on.", "max_output_tokens": 12},
        {"input": "Shorter, please.", "max_output_tokens": 8, **NO_THINK},
    ],
}


def _post(base_url: str, body: dict[str, Any], stream: bool) -> tuple[int, Any]:
    """One turn: its status and its answer (a stream: the `response.completed` response, and
    the normalized stream)."""
    body = {**body, "model": "tiny", **GREEDY, "stream": stream}
    response = httpx.post(base_url + "/v1/responses", json=body, timeout=120)
    if response.status_code != 200 or not stream:
        return response.status_code, response.json()
    for block in response.content.split(b"\n\n"):
        if b"event: response.completed" in block:
            data = orjson.loads(block.split(b"data: ", 1)[1])
            return 200, {**data["response"], "_stream": normalize_stream(response.content).normalized}
    raise AssertionError(f"no response.completed in {response.content[-400:]!r}")


def _chain(base_url: str, turns: list[dict[str, Any]], stream: bool) -> list[Any]:
    """Each turn continuing the one before (a tool call's output answered with its call id)."""
    answers: list[Any] = []
    previous: dict[str, Any] | None = None
    for turn in turns:
        body = dict(turn)
        if previous is not None:
            body["previous_response_id"] = previous["id"]
            calls = [item for item in previous["output"] if item["type"] == "function_call"]
            if body["input"] == "<call output>":
                body["input"] = [
                    {"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny, 21 C"}
                    for call in calls
                ]
        status, previous = _post(base_url, body, stream)
        assert status == 200, previous
        answers.append(previous)
    return answers


def _same(answer: dict[str, Any]) -> dict[str, Any]:
    normalized = normalize_response(answer).normalized
    normalized["previous_response_id"] = "present" if answer.get("previous_response_id") else None
    if "_stream" in answer:
        normalized["stream"] = answer["_stream"]
    return normalized


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("chain", list(CHAINS))
def test_a_chain_of_turns_equals_native_vllm_with_its_store(chain: str, stream: bool, stack: RunningStack) -> None:
    _chain(stack.engine_url, CHAINS[chain], stream)  # every prompt cached: both count the same cache hits
    native = _chain(stack.engine_url, CHAINS[chain], stream)
    gateway = _chain(stack.base_url, CHAINS[chain], stream)
    if chain == "tool-call":
        assert any(item["type"] == "function_call" for item in native[0]["output"]), native[0]
    if chain == "reasoning":
        assert any(item["type"] == "reasoning" for item in native[0]["output"]), native[0]
    for turn, (ours, theirs) in enumerate(zip(gateway, native, strict=True)):
        assert _same(ours) == _same(theirs), f"turn {turn + 1}"
    # the later turns' prompts hold the earlier ones: native's usage counts them alike
    assert [a["usage"]["input_tokens"] for a in gateway] == [a["usage"]["input_tokens"] for a in native]
    # each turn retrieved as it was stored, whole or streamed, as native retrieves its own
    for url, answers in ((stack.base_url, gateway), (stack.engine_url, native)):
        for answer in answers:
            kept = httpx.get(f"{url}/v1/responses/{answer['id']}", timeout=10)
            answered = {key: value for key, value in answer.items() if key != "_stream"}
            assert kept.status_code == 200 and _same(kept.json()) == _same(answered)


def test_retrieve_and_cancel_answer_as_native(stack: RunningStack) -> None:
    body = {"input": ENGLISH, "max_output_tokens": 6, **NO_THINK}
    answers = {url: _post(url, body, False)[1] for url in (stack.engine_url, stack.base_url)}
    for url, answer in answers.items():
        got = httpx.get(f"{url}/v1/responses/{answer['id']}", timeout=10)
        assert got.status_code == 200 and got.json() == answer
    native, ours = answers[stack.engine_url], answers[stack.base_url]
    for path, method in (("", "GET"), ("/cancel", "POST")):
        replies = [
            httpx.request(method, f"{url}/v1/responses/{a['id']}{path}", timeout=10) for url, a in answers.items()
        ]
        if path:  # a finished response: native refuses to cancel it
            assert [r.status_code for r in replies] == [400, 400] and replies[0].json() == replies[1].json()
        unknown = [httpx.request(method, f"{url}/v1/responses/resp_nope{path}", timeout=10) for url in answers]
        assert [r.status_code for r in unknown] == [404, 404] and unknown[0].json() == unknown[1].json()
    assert _same(ours) == _same(native)


def test_delete_and_input_items_follow_openais_reference(stack: RunningStack) -> None:
    first = _post(stack.base_url, {"input": "Hello", "max_output_tokens": 4, **NO_THINK}, False)[1]
    items = [
        {"role": "user", "content": "One"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Two"}]},
    ]
    second = _post(
        stack.base_url, {"input": items, "previous_response_id": first["id"], "max_output_tokens": 4, **NO_THINK}, False
    )[1]
    url = f"{stack.base_url}/v1/responses/{second['id']}/input_items"
    listed = httpx.get(url, timeout=10).json()
    assert listed["object"] == "list" and listed["has_more"] is False
    texts = [item["content"][0]["text"] for item in listed["data"]]
    assert texts == ["Two", "One"]  # this turn's input only, newest first (OpenAI's default order)
    assert all(item["id"] and item["type"] == "message" and item["role"] == "user" for item in listed["data"])
    assert listed["first_id"] == listed["data"][0]["id"] and listed["last_id"] == listed["data"][-1]["id"]
    page = httpx.get(url, params={"order": "asc", "limit": 1}, timeout=10).json()
    assert [i["content"][0]["text"] for i in page["data"]] == ["One"] and page["has_more"] is True
    rest = httpx.get(url, params={"order": "asc", "after": page["last_id"]}, timeout=10).json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["Two"] and rest["has_more"] is False
    assert httpx.get(url, params={"limit": 0}, timeout=10).status_code == 400

    deleted = httpx.delete(f"{stack.base_url}/v1/responses/{first['id']}", timeout=10)
    assert deleted.status_code == 200 and deleted.json() == {"id": first["id"], "object": "response", "deleted": True}
    for gone in (
        httpx.get(f"{stack.base_url}/v1/responses/{first['id']}", timeout=10),
        httpx.delete(f"{stack.base_url}/v1/responses/{first['id']}", timeout=10),
        httpx.post(
            stack.base_url + "/v1/responses",
            json={"model": "tiny", "input": "More", "previous_response_id": first["id"]},
            timeout=10,
        ),
    ):
        assert gone.status_code == 404, gone.text
        assert gone.json()["error"]["message"] == f"Response with id '{first['id']}' not found."
    # the turn that continued it is its own: still there
    assert httpx.get(f"{stack.base_url}/v1/responses/{second['id']}", timeout=10).status_code == 200


def test_a_response_not_stored_is_not_found(stack: RunningStack) -> None:
    answer = _post(stack.base_url, {"input": "Hi", "max_output_tokens": 2, "store": False, **NO_THINK}, False)[1]
    assert answer["status"] == "incomplete"
    assert httpx.get(f"{stack.base_url}/v1/responses/{answer['id']}", timeout=10).status_code == 404


def test_the_official_openai_client_continues_retrieves_lists_and_deletes(stack: RunningStack) -> None:
    import openai

    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    extra = {"extra_body": NO_THINK, "temperature": 0.0, "max_output_tokens": 6}
    first = client.responses.create(model="tiny", input="Hello", **extra)
    second = client.responses.create(model="tiny", input="Again", previous_response_id=first.id, **extra)
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id) == second
    listed = client.responses.input_items.list(second.id)
    assert [item.type for item in listed.data] == ["message"] and listed.data[0].content[0].text == "Again"
    assert client.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
